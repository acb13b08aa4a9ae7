"""Ingest: look at the source once and record what the run is.

Ingest scans the source's frames (their true count and where each one is), streams the audio into the store and
writes the manifest with the plan; from then on every stage reads its input from the store, or, for a window's
frames, from the source itself.
"""

from __future__ import annotations

import time

import numpy as np
from prefect import task

from k6vsr_core import media
from k6vsr_core.bundle import BundleInfo, model_traits
from k6vsr_core.compute import apply_profile, default_profile
from k6vsr_core.params import UpscaleParams
from k6vsr_core.runner import audio_input, read_source
from service.runs import RunRef
from storage import RunManifest, RunStore, source_info
from storage.manifest import library_versions
from tasks.descriptors import IngestResult
from tasks.stage_tasks import STAGE_TASK


def _readable_manifest(store: RunStore) -> RunManifest | None:
    """A missing or damaged manifest means ingest is not done: every later stage reads its plan from it."""
    try:
        return store.read_manifest()
    except (OSError, ValueError):
        return None


@task(name="ingest", task_run_name="ingest-{run.run_key}", **STAGE_TASK)
def ingest(source: str, run: RunRef, params: UpscaleParams, info: BundleInfo, attempt: str) -> IngestResult:
    """Scan the source's frames, stream its audio into the store and write the manifest: no frame is kept, each
    window reads its own from the source."""
    store = RunStore(run.store_root, run.run_key)
    manifest = _readable_manifest(store)
    if manifest is not None and store.get("frame_pts", stage="ingest") is not None:
        return IngestResult(stage="ingest", computed=False, plan=manifest.plan)
    started = time.perf_counter()
    # Chosen here, once per run: every later stage, in any process, computes as this records.
    compute = default_profile()
    apply_profile(compute)
    clip = read_source(source, params, model_traits(info))
    plan = clip.plan
    tmp = store.temp_file(store.path, ".f32")
    try:
        audio_from = audio_input(source, params)
        samples = media.write_audio_track(audio_from, tmp, plan.num_frames, plan.frame_rate) if audio_from else 0
        if samples:
            store.commit_file(tmp, store.audio_path, "ingest", "audio", attempt=attempt)
    finally:
        tmp.unlink(missing_ok=True)
    manifest = RunManifest(
        run_key=run.run_key,
        source=source_info(source),
        params=params,
        model=info,
        plan=plan,
        seeds=[chunk.seed for chunk in plan.chunks],
        has_audio=samples > 0,
        rotation=clip.rotation,
        versions=library_versions(),
        compute=compute,
    )
    store.write_manifest(manifest)
    seconds = time.perf_counter() - started
    # The frame index is the ingest record: written last, after the manifest and the audio. Empty: not seekable.
    pts = clip.frame_pts if clip.frame_pts is not None else np.zeros(0, dtype=np.int64)
    store.put("frame_pts", pts, stage="ingest", seconds=seconds, attempt=attempt)
    return IngestResult(stage="ingest", computed=True, seconds=seconds, plan=plan)
