"""Ingest: look at the source once and record what the run is.

Ingest scans the source's frames (their true count and where each one is), streams the audio into the store and
writes the manifest with the plan; from then on every stage reads its input from the store, or, for a window's
frames, from the source itself.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from prefect import task

from k6vsr_core import media
from k6vsr_core.contract.latent import latent_clip, read_latent
from k6vsr_core.contract.params import UpscaleParams
from k6vsr_core.contract.plan import ClipPlan
from k6vsr_core.contract.source import audio_input, read_source
from k6vsr_core.contract.stage_names import Stage, TaskKind
from k6vsr_core.device.compute import ComputeProfile, apply_profile, default_profile
from k6vsr_core.errors import ParameterError
from k6vsr_core.model.bundle import BundleInfo, model_traits
from service.runs import PreparedRun, latent_channels
from storage import RunManifest, RunStore, SourceInfo, source_info
from storage.manifest import library_versions
from tasks.descriptors import IngestResult
from tasks.stage_tasks import STAGE_TASK


def _readable_manifest(store: RunStore) -> RunManifest | None:
    """A missing or damaged manifest means ingest is not done: every later stage reads its plan from it."""
    try:
        return store.read_manifest()
    except (OSError, ValueError):
        return None


def _ingested(store: RunStore, manifest: RunManifest, source: str) -> IngestResult:
    """An ingest done before, by this run or an earlier one of the same content, perhaps from another path (a
    resubmitted HTTP job has its own copy, the first one's may be gone): the stages that read the source from then on
    read it where it is now."""
    if manifest.source.path != str(Path(source).resolve()):
        store.write_manifest(manifest.model_copy(update={"source": source_info(source)}))
    store.keep_source(source)
    return IngestResult(stage=Stage.INGEST, computed=False, plan=manifest.plan)


def _store_audio(store: RunStore, source: str, params: UpscaleParams, plan: ClipPlan, attempt: str) -> bool:
    """Stream the audio the request writes (the source's, or a separate file's) into the store; False if none."""
    tmp = store.temp_file(store.audio_path, ".f32")
    try:
        audio_from = audio_input(source, params)
        samples = media.write_audio_track(audio_from, tmp, plan.num_frames, plan.clock) if audio_from else 0
        if samples:
            store.commit_file(tmp, store.audio_path, Stage.INGEST, "audio", attempt=attempt)
    finally:
        tmp.unlink(missing_ok=True)
    return samples > 0


def _write_manifest(
    store: RunStore,
    source: SourceInfo,
    params: UpscaleParams,
    info: BundleInfo,
    plan: ClipPlan,
    compute: ComputeProfile,
    attempt: str,
    rotation: int = 0,
    latent_fps: str | None = None,
) -> None:
    """Store the run's audio, then its manifest: what every later stage reads its plan and inputs from."""
    has_audio = _store_audio(store, source.path, params, plan, attempt)
    store.write_manifest(
        RunManifest(
            run_key=store.run_key,
            source=source,
            params=params,
            model=info,
            plan=plan,
            seeds=[chunk.seed for chunk in plan.chunks],
            has_audio=has_audio,
            rotation=rotation,
            versions=library_versions(),
            compute=compute,
            latent_fps=latent_fps,
        )
    )


@task(name=TaskKind.INGEST, task_run_name="ingest-{prepared.run.run_key}", **STAGE_TASK)
def ingest(prepared: PreparedRun, attempt: str) -> IngestResult:
    """Scan the source's frames, stream its audio into the store and write the manifest with the run's plan: no
    frame is kept, each window reads its own from the source. A latent run's source is a latent (`ingest_latent`)."""
    if prepared.latent_fps is not None:
        return ingest_latent(prepared, attempt)
    run, source, params = prepared.run, prepared.source, prepared.plan.params
    store = run.open()
    manifest = _readable_manifest(store)
    if manifest is not None and store.get("frame_pts", stage=Stage.INGEST) is not None:
        return _ingested(store, manifest, source)
    started = time.perf_counter()
    # Chosen here, once per run: every later stage, in any process, computes as this records. Not applied here:
    # reading the source computes no tensor, and with warm workers this process imports no torch.
    compute = default_profile()
    clip = read_source(source, params, model_traits(prepared.model_info), planned=prepared.plan)
    plan = clip.plan
    store.keep_source(source, attempt)
    _write_manifest(store, source_info(source), params, prepared.model_info, plan, compute, attempt, clip.rotation)
    seconds = time.perf_counter() - started
    # The frame index is the ingest record: written last, after the manifest and the audio. Empty: not seekable.
    pts = clip.frame_pts if clip.frame_pts is not None else np.zeros(0, dtype=np.int64)
    store.put("frame_pts", pts, stage=Stage.INGEST, seconds=seconds, attempt=attempt)
    return IngestResult(stage=Stage.INGEST, computed=True, seconds=seconds, plan=plan)


def ingest_latent(prepared: PreparedRun, attempt: str) -> IngestResult:
    """A latent run's ingest: check the latent, store the audio of `--audio FILE` if given, and write the manifest
    with the run's plan. There are no source frames to index, and the latent itself is read by the encode stage,
    from its file. The plan's params are the run's (`k6vsr_core.contract.latent.latent_params`)."""
    run, source, plan, info = prepared.run, prepared.source, prepared.plan, prepared.model_info
    store = run.open()
    manifest = _readable_manifest(store)
    if manifest is not None and store.records.read(Stage.INGEST, "all") is not None:
        return _ingested(store, manifest, source)
    started = time.perf_counter()
    compute = default_profile()
    apply_profile(compute)
    # Read again, as the encode stage will: a latent file changed since the run was planned is refused here.
    latent, rate = read_latent(source, latent_channels(info), plan.params, prepared.latent_fps)
    if latent_clip(latent) != (plan.source_frames, plan.source_size) or str(rate) != prepared.latent_fps:
        raise ParameterError(f"latent={source!r} changed since the run was planned; start it again")
    del latent
    described = source_info(source)
    store.keep_source(source, attempt)
    _write_manifest(store, described, plan.params, info, plan, compute, attempt, latent_fps=str(rate))
    seconds = time.perf_counter() - started
    # The ingest record, written last as for a video: it names the latent file's content it planned.
    store.records.write(Stage.INGEST, "all", described.sha256, seconds, attempt)
    return IngestResult(stage=Stage.INGEST, computed=True, seconds=seconds, plan=plan)
