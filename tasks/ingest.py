"""Planning and ingest: identify the run, decode the source once, and record what the run is.

Planning needs no weights: the model's identity, trained tile sizes and sampler come from the bundle's configs and
weight headers. Ingest decodes the kept frames and the audio into the store and writes the manifest; from then on
every stage reads its input from the store.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task
from pydantic import BaseModel

from k6vsr_core import media
from k6vsr_core.compute import apply_profile, default_profile
from k6vsr_core.bundle import BundleInfo, DEFAULT_MODEL, DEFAULT_REVISION, inspect_bundle, resolve_bundle_path
from k6vsr_core.params import ParameterError, UpscaleParams
from k6vsr_core.plan import ClipPlan, ModelTraits, make_plan
from k6vsr_core.runner import read_source
from storage import RunManifest, RunStore, run_key, source_info
from storage.manifest import library_versions
from tasks.descriptors import ModelSpec, RunRef, StageResult
from tasks.stage_tasks import STAGE_TASK


class PreparedRun(BaseModel):
    run: RunRef
    source: str
    model_info: BundleInfo
    probe: media.VideoProbe
    plan: ClipPlan  # from the probe; ingest re-plans on the frames actually decoded
    finished: bool


def model_info(spec: ModelSpec) -> BundleInfo:
    """The model's identity and traits, from its configs and weight headers only."""
    revision = spec.revision
    if revision is None and spec.model == DEFAULT_MODEL:
        revision = DEFAULT_REVISION
    path = resolve_bundle_path(spec.model, revision)
    is_local = Path(spec.model).expanduser().exists()
    # A local copy keeps the identity of its origin when given `--model-id` (and `--revision`).
    model_id = spec.model_id or (None if is_local else spec.model)
    return inspect_bundle(path, model_id=model_id, revision=revision).info


def traits(info: BundleInfo) -> ModelTraits:
    return ModelTraits(tile_sizes=info.tile_sizes, scheduler=info.scheduler, trained_steps=info.trained_steps)


def prepare_run(source: str | Path, params: UpscaleParams, spec: ModelSpec, store_root: str | Path) -> PreparedRun:
    """Everything `k6vsr plan` prints, and the run key: no model is loaded and nothing is written."""
    probe = media.probe(source)
    try:
        indices, fps = media.select_frames(probe.num_frames, probe.fps)
    except ValueError as err:  # too few frames for the rate: a property of the file
        raise media.MediaError(source, str(err)) from None
    info = model_info(spec)
    try:
        plan = make_plan((probe.height, probe.width), len(indices), fps, params, traits(info))
    except ParameterError:
        raise
    except ValueError as err:  # e.g. an `exact` target above this clip's result: the request, for this file
        raise ValueError(f"{source}: {err}") from None
    key = run_key(source_info(source).sha256, params, info.identity)
    run = RunRef(store_root=str(store_root), run_key=key)
    return PreparedRun(
        run=run,
        source=str(Path(source).resolve()),
        model_info=info,
        probe=probe,
        plan=plan,
        finished=RunStore(store_root, key).output_done(),
    )


def _manifest_readable(store: RunStore) -> bool:
    """A missing or damaged manifest means ingest is not done: every later stage reads its plan from it."""
    try:
        store.read_manifest()
    except (OSError, ValueError):
        return False
    return True


@task(name="ingest", task_run_name="ingest-{run.run_key}", **STAGE_TASK)
def ingest(source: str, run: RunRef, params: UpscaleParams, info: BundleInfo) -> StageResult:
    """Decode the kept frames and the mono 44.1 kHz audio into the store, and write the manifest."""
    store = RunStore(run.store_root, run.run_key)
    if _manifest_readable(store) and store.get("frames", stage="ingest") is not None:
        return StageResult(stage="ingest", computed=False)
    started = time.perf_counter()
    # Chosen here, once per run: every later stage, in any process, computes as this records.
    compute = default_profile()
    apply_profile(compute)
    decoded = read_source(source, params, traits(info))
    manifest = RunManifest(
        run_key=run.run_key,
        source=source_info(source),
        params=params,
        model=info,
        plan=decoded.plan,
        seeds=[chunk.seed for chunk in decoded.plan.chunks],
        has_audio=decoded.audio is not None and decoded.audio.size > 0,
        rotation=decoded.rotation,
        versions=library_versions(),
        compute=compute,
    )
    store.write_manifest(manifest)
    if manifest.has_audio:
        store.put("audio", decoded.audio, stage="ingest", item="audio")
    seconds = time.perf_counter() - started
    # The frames record is the ingest record: written last, after the manifest and the audio.
    store.put("frames", decoded.frames, stage="ingest", seconds=seconds)
    return StageResult(stage="ingest", computed=True, seconds=seconds)
