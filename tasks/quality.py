"""The quality report of a run's output (`k6vsr_core.contract.quality`), measured window by window and kept in the run
store.

Each window's part is measured on the CPU lane as soon as its segment is written (`measure_window`, the last step of the
window's `blend-segment` task), from the segment file and the source, while the model computes the windows after it, and
kept in the store (`quality/<window>.npz`; a resumed run finds it there). After the mux, `measure_quality` only joins
the parts (and measures the pair that crosses each segment's start) into the report, `quality.json`. A part missing then
(its item failed) is measured there; an output whose segments are gone is measured whole. A measurement that fails is
logged and the run goes on without it: the report describes the output, it never decides it.
"""

from __future__ import annotations

import logging
import time

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError

from k6vsr_core.contract.quality import Measures, QualityReport, combine, measure_files, measure_segment, tile_borders
from k6vsr_core.contract.stage_names import Stage, TaskKind
from service.runs import RunRef
from storage import RunStore
from storage.location import Location
from tasks.descriptors import StageResult

REPORT = "quality.json"
QUALITY = "quality"  # the folder of the windows' parts


def _logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:  # called outside a task (a test, a bench)
        return logging.getLogger(__name__)


def part_path(store: RunStore, window: int) -> Location:
    return store.where / QUALITY / f"{window:06d}.npz"


def _part_done(store: RunStore, window: int) -> bool:
    return store.file_done(part_path(store, window), Stage.QUALITY, str(window))


def _measure_part(store: RunStore, window: int, attempt: str) -> Measures:
    """Measure window `window`'s segment and keep the part in the store (atomically, then its record)."""
    manifest = store.read_manifest()
    pts = store.get("frame_pts", stage=Stage.INGEST)
    with store.segment_path(window).fetch() as segment:
        measures = measure_segment(
            manifest.plan, window, segment, store.source_file(manifest), pts if pts is not None and len(pts) else None
        )
    path = part_path(store, window)
    tmp = store.temp_file(path, ".npz")
    try:
        tmp.write_bytes(measures.to_bytes())
        store.commit_file(tmp, path, Stage.QUALITY, str(window), measures.seconds, attempt)
    finally:
        tmp.unlink(missing_ok=True)
    return measures


def measure_window(run: RunRef, window: int, attempt: str) -> StageResult:
    """Window `window`'s part of the report, once its segment is written; never fails (the part is then measured
    after the mux). Not a task of its own: it ends the window's `blend-segment` task (`tasks.stage_tasks`)."""
    store = run.open()
    skipped = StageResult(stage=Stage.QUALITY, item=str(window), computed=False, window=window)
    try:
        if store.read_manifest().latent_fps is not None or _part_done(store, window):
            return skipped
        if store.file_done(store.where / REPORT, Stage.QUALITY, "all"):
            return skipped
        measures = _measure_part(store, window, attempt)
    except Exception as err:  # noqa: BLE001 - a report never fails the run it describes
        _logger().warning("could not measure the quality of window %d: %s", window, err)
        return skipped
    return StageResult(stage=Stage.QUALITY, item=str(window), computed=True, seconds=measures.seconds, window=window)


@task(name=TaskKind.QUALITY, task_run_name="quality-{run.run_key}", cache_policy=NO_CACHE)
def measure_quality(run: RunRef, attempt: str) -> QualityReport | None:
    """The output's quality report, joined from the windows' parts; None for a latent run (no source frames to
    compare with) or when it fails."""
    store = run.open()
    path = store.where / REPORT
    try:
        manifest = store.read_manifest()
        if manifest.latent_fps is not None:
            return None
        if store.file_done(path, Stage.QUALITY, "all"):
            return QualityReport.model_validate_json(path.read_bytes())
        started = time.perf_counter()
        plan = manifest.plan
        windows = range(plan.num_windows)
        if all(_part_done(store, w) or store.segment_done(w) for w in windows):
            parts = [
                Measures.from_bytes(part_path(store, w).read_bytes())
                if _part_done(store, w)
                else _measure_part(store, w, attempt)
                for w in windows
            ]
            report = combine(parts, plan.windows, plan.cuts, tile_borders(plan))
        else:  # a store whose segments were removed: the output itself
            with store.output_path.fetch() as output:
                report = measure_files(plan, output, store.source_file(manifest))
        tmp = store.temp_file(path, ".json")
        try:
            tmp.write_text(report.model_dump_json(indent=2))
            store.commit_file(tmp, path, Stage.QUALITY, "all", time.perf_counter() - started, attempt)
        finally:
            tmp.unlink(missing_ok=True)
        return report
    except Exception as err:  # noqa: BLE001 - a report never fails the run it describes
        get_run_logger().warning("could not measure the output's quality: %s", err)
        return None
