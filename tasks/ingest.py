"""Ingest: decode the source once and record what the run is.

Ingest decodes the kept frames and the audio into the store and writes the manifest; from then on every stage reads
its input from the store.
"""

from __future__ import annotations

import time

from prefect import task

from k6vsr_core.bundle import BundleInfo, model_traits
from k6vsr_core.compute import apply_profile, default_profile
from k6vsr_core.params import UpscaleParams
from k6vsr_core.runner import read_source
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
    """Decode the kept frames and the mono 44.1 kHz audio into the store, and write the manifest."""
    store = RunStore(run.store_root, run.run_key)
    manifest = _readable_manifest(store)
    if manifest is not None and store.get("frames", stage="ingest") is not None:
        return IngestResult(stage="ingest", computed=False, plan=manifest.plan)
    started = time.perf_counter()
    # Chosen here, once per run: every later stage, in any process, computes as this records.
    compute = default_profile()
    apply_profile(compute)
    decoded = read_source(source, params, model_traits(info))
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
        store.put("audio", decoded.audio, stage="ingest", item="audio", attempt=attempt)
    seconds = time.perf_counter() - started
    # The frames record is the ingest record: written last, after the manifest and the audio.
    store.put("frames", decoded.frames, stage="ingest", seconds=seconds, attempt=attempt)
    return IngestResult(stage="ingest", computed=True, seconds=seconds, plan=decoded.plan)
