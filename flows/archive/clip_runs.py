"""The archive's pending clips run, each as its own clip flow run, a few at once, on one shared tiles cluster."""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from flows import artifacts
from flows.archive.report import ManifestArtifact, write_manifest
from flows.archive.rows import ArchiveRow, reason_of
from flows.clip_context import ClipRunContext
from flows.orchestrate import run_clip
from runtime.lanes import SharedQueue
from runtime.runners import make_task_runner, resolve_address, start_cluster, uses_processes
from runtime.warm_workers import split_cluster
from service.runs import ModelSpec, PreparedRun

# The manifest artifact is rewritten whole on each update: at most once per this many seconds, and at the end.
TABLE_EVERY_S = 10.0
# A clip whose run failed because the Prefect API answered busy (SQLite locked past its timeout under load answers
# 503, after the client's own retries) is run again, in a new flow run, after a pause: its finished work is in the
# store, so only the rest is computed. Seen at 2 or 3 clips in 200 on a loaded 2-core machine (bench/RESULTS.md).
API_BUSY_RETRIES = 2
API_BUSY_PAUSE_S = 5.0
API_BUSY_STATUSES = (429, 502, 503, 504)


@contextlib.contextmanager
def shared_tiles_cluster(
    workers: int, gpus: bool, dask_address: str | None, own: str | None = None
) -> Iterator[str | None]:
    """The Dask scheduler every clip sends its tiles to: the given one, the warm workers, one started here (asked
    for, or with `own`, the model to load, the archive's own split cluster), or None (threads)."""
    dask_address = resolve_address(workers, gpus, dask_address)
    if dask_address:
        yield dask_address
        return
    if not uses_processes(workers, gpus, None):
        if own is None:
            yield None
            return
        with split_cluster(own) as cluster:
            yield cluster.scheduler_address
        return
    cluster = start_cluster(workers, gpus)
    with cluster:
        yield cluster.scheduler_address


def run_clips(
    rows: list[ArchiveRow],
    pending: list[int],
    plans: dict[str, PreparedRun],
    model: ModelSpec,
    address: str | None,
    max_parallel: int,
    out_dir: Path,
    header: dict[str, Any],
    manifest_artifact: ManifestArtifact,
    progress: artifacts.ArchiveProgress,
) -> None:
    """Run the clips of `rows` at `pending`, `max_parallel` at once, each as a subflow of this flow run: every row is
    updated as its clip ends, and the manifest written and shown again."""
    logger = get_run_logger()
    clip_runs: dict[str, str] = {}  # relative path -> the clip's flow run id

    # A thread pool, not Prefect's own fan-out: a subflow runs in the thread that calls it (prefect 3.9), and
    # `Flow.submit` sends a flow to a work pool's infrastructure, a new process per run that loads the model again;
    # a concurrency limit bounds runs but starts none; and a clip run started from a task would file its artifacts
    # under that task (flows.artifacts).
    shared = SharedQueue()
    runner = make_task_runner(1, address, False)  # every clip's tiles: the shared cluster, else this process's threads

    def run(index: int) -> tuple[int, ArchiveRow, float, str | None]:
        """The clip's finished row. Its summary (its quality report with it) or its error (with the frames of its
        traceback) is dropped here, not kept by the list of futures for as long as the archive runs."""
        row = rows[index]
        # Named after the clip; its model work after every earlier clip's, before later ones'.
        context = ClipRunContext(name=f"upscale-{row.relative_path}", queue=shared, rank=index)
        progress.started(row.relative_path, plans[row.relative_path].run.open())
        started = time.perf_counter()
        for attempt in range(1 + API_BUSY_RETRIES):
            clip_run: str | None = None
            try:
                ended = run_clip(plans[row.relative_path], row.output, model, runner, context)
                clip_run, outcome = ended.flow_run_id, ended.outcome
            except Exception as err:  # noqa: BLE001 - one bad clip never stops the others
                outcome = err
            if attempt == API_BUSY_RETRIES or not api_busy(outcome):
                break
            logger.warning("clip %s: the Prefect API was busy (%s); running it again", row.relative_path, outcome)
            time.sleep(API_BUSY_PAUSE_S)
        if isinstance(outcome, BaseException) and api_lost(outcome):
            raise outcome
        seconds = time.perf_counter() - started
        return index, _finished_row(row, seconds, outcome), seconds, clip_run

    with (
        progress.watching(),
        clip_runs_without_heartbeats(),
        ThreadPoolExecutor(max_workers=max(1, max_parallel), thread_name_prefix="archive-clip") as pool,
    ):
        # Each clip runs in a copy of this flow run's context, so its flow run is a subflow of this run.
        futures = [pool.submit(contextvars.copy_context().run, run, index) for index in pending]
        try:
            _collect(futures, rows, clip_runs, manifest_artifact, progress, out_dir, header, len(pending))
        except BaseException:
            for future in futures:  # the clips not started yet: the archive stops (its API is gone, or an interrupt)
                future.cancel()
            raise


def _collect(
    futures: list[Future[tuple[int, ArchiveRow, float, str | None]]],
    rows: list[ArchiveRow],
    clip_runs: dict[str, str],
    manifest_artifact: ManifestArtifact,
    progress: artifacts.ArchiveProgress,
    out_dir: Path,
    header: dict[str, Any],
    pending: int,
) -> None:
    """Each clip's row as its run ends: logged, the manifest written, the table shown now and then."""
    logger = get_run_logger()
    last_table = time.monotonic()
    for finished, future in enumerate(as_completed(futures), start=1):
        index, row, seconds, clip_run = future.result()
        rows[index] = row
        if clip_run is not None:
            clip_runs[row.relative_path] = clip_run
        progress.finished(row.relative_path, failed=row.status == "failed")
        if row.status == "failed":
            logger.error("clip %s failed: %s", row.relative_path, row.reason)
        else:
            logger.info(
                "clip %s done in %.1f s (%s tiles computed, %s reused)",
                row.relative_path,
                seconds,
                row.tiles_computed,
                row.tiles_reused,
            )
        write_manifest(out_dir, header, rows)
        if time.monotonic() - last_table >= TABLE_EVERY_S or finished == pending:
            manifest_artifact.show(rows, clip_runs)
            last_table = time.monotonic()


@contextlib.contextmanager
def clip_runs_without_heartbeats() -> Iterator[None]:
    """Clip runs started in the block (in threads that copy its context) send no heartbeats of their own.

    Prefect joins a flow run's heartbeat thread as the run ends, and that thread looks for its stop once a second:
    half a second a clip on average, while the clip thread holds its slot. The archive run's own heartbeats go on
    (its engine read the setting as it started), so a killed archive still stops beating, and each clip run's lease
    (runtime.flow_leases) marks it Crashed once its process is gone.
    """
    from prefect.settings import temporary_settings

    with temporary_settings(updates={"flows.heartbeat_frequency": None}):
        yield


def api_lost(outcome: BaseException) -> bool:
    """The error is the Prefect API no longer answering (its server killed, or gone): every clip after it would
    fail the same way, each after the client's minute of retries, so the archive stops there instead, and the
    command says so in one line (`runtime.prefect_api.lost_api`)."""
    from prefect.settings import get_current_settings

    from runtime.api_loss import lost_api

    return lost_api(outcome, str(get_current_settings().api.url)) is not None


def api_busy(outcome: Any) -> bool:
    """The outcome is the Prefect API's busy answer, not the clip's own failure."""
    from prefect.exceptions import PrefectHTTPStatusError

    return isinstance(outcome, PrefectHTTPStatusError) and outcome.response.status_code in API_BUSY_STATUSES


def _finished_row(row: ArchiveRow, seconds: float, outcome: Any) -> ArchiveRow:
    if isinstance(outcome, BaseException):
        return row.model_copy(update={"status": "failed", "reason": reason_of(outcome), "seconds": round(seconds, 3)})
    return row.model_copy(
        update={
            "status": "done",
            "reason": "published from the finished run in the store" if outcome.reused_output else "",
            "run_key": outcome.run_key,
            "frames": outcome.frames,
            "tiles": outcome.tiles_total,
            "tiles_computed": outcome.tiles_computed,
            "tiles_reused": outcome.tiles_reused,
            "seconds": round(seconds, 3),
            "output": outcome.output,
        }
    )
