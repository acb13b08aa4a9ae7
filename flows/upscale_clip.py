"""The clip flow: ingest -> encode -> denoise per tile chunk -> decode per tile -> blend -> mux -> publish.

Every stage is persisted in the run store, so a crash, a killed worker or a bad tile costs only the unfinished
work: the next run of the same clip and parameters finds the finished stages by their records and skips them.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.futures import as_completed
from prefect.runtime import flow_run
from pydantic import BaseModel

from flows import artifacts
from flows.prefect_server import leased
from flows.run_log import run_log
from flows.stage_clock import StageClock
from k6vsr_core.params import UpscaleParams
from k6vsr_core.plan import ClipPlan
from service.runs import ModelSpec, PreparedRun, RunRef, prepare_run
from storage import RunStore, default_store_root
from tasks import ingest as ingest_tasks
from tasks import stage_tasks
from tasks.descriptors import StageResult


class ClipSummary(BaseModel):
    source: str
    output: str
    run_key: str
    store: str
    log: str
    frames: int
    fps: int
    size: tuple[int, int]  # (width, height) of the written video
    tiles_total: int
    tiles_computed: int
    tiles_reused: int
    dit_calls: int
    timings: dict[str, float]
    reused_output: bool


class TileFailure(RuntimeError):
    """Some tiles failed on every attempt; every finished tile stays stored for the next run."""


class WorkersUnavailable(RuntimeError):
    """Worker processes did not run a trivial task in time (not started, or cannot import k6vsr)."""


# Long enough for a cluster of GPU workers to start and import torch; a worker that cannot import k6vsr would
# otherwise be restarted by Dask forever and the run would hang instead of failing.
WORKERS_READY_TIMEOUT_S = float(os.environ.get("K6VSR_WORKERS_READY_TIMEOUT", "300"))


def _check_workers() -> None:
    """With process workers, one trivial task must complete before tiles are sent."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or type(context.task_runner).__name__ != "DaskTaskRunner":
        return
    future = stage_tasks.workers_ready.submit()
    future.wait(timeout=WORKERS_READY_TIMEOUT_S)
    if not future.state.is_completed():
        raise WorkersUnavailable(
            f"no Dask worker ran a trivial k6vsr task within {WORKERS_READY_TIMEOUT_S:g} s "
            f"(state {future.state.name}): check that k6vsr is installed where the workers run and that they "
            "started (K6VSR_WORKERS_READY_TIMEOUT sets the wait)"
        )


def default_output_name(source: str | Path, params: UpscaleParams, now: datetime | None = None) -> str:
    """`<stem>_sr<scale>x_<timestamp>.mp4`, the name SGLang users know."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return f"{Path(source).stem}_sr{params.scale_label}x_{stamp}.mp4"


def _attempt_id() -> str:
    """The name this attempt writes into every record it makes: its flow-run id, else a fresh one."""
    return flow_run.id or uuid.uuid4().hex


def _flow_run_name() -> str:
    source = flow_run.parameters.get("source", "clip")
    return f"upscale-{Path(str(source)).name}"


@flow(name="upscale-clip", flow_run_name=_flow_run_name, log_prints=False, validate_parameters=True)
@leased  # a run whose process is killed is marked Crashed by the next command
def upscale_clip(
    source: str,
    output: str | None = None,
    params: UpscaleParams = UpscaleParams(),
    model: ModelSpec = ModelSpec(),
    store_root: str | None = None,
    prepared: PreparedRun | None = None,
) -> ClipSummary:
    """Upscale one clip into `output` (a file path; default: `<stem>_sr<scale>x_<timestamp>.mp4` beside it).

    `prepared` is the plan its caller made of this clip with these arguments (`service.runs.prepare_run`); without
    it, the flow plans the clip itself. From ingest on, the flow runs the plan that ingest recorded in the manifest.
    """
    clock = StageClock()
    logger = get_run_logger()
    if prepared is None:
        prepared = prepare_run(source, params, model, store_root or default_store_root())
    run, params = prepared.run, prepared.plan.params
    store = RunStore(run.store_root, run.run_key)
    destination = Path(output) if output else Path(source).parent / default_output_name(source, params)

    def record(result: StageResult) -> StageResult:
        clock.finished(result.stage, result.seconds)
        return result

    attempt = _attempt_id()
    with store.in_use(), run_log(store.log_path, attempt):
        logger.info("run %s: %d tiles, store %s", run.run_key, prepared.plan.num_tiles, store.path)
        ingested = ingest_tasks.ingest(prepared.source, run, params, prepared.model_info, attempt)
        record(ingested)
        plan = ingested.plan
        progress = artifacts.TileProgress(prepared.source, run.run_key, flow_run.id, plan.num_tiles)
        denoised: list[StageResult] = []
        if store.output_done():
            progress.update(plan.num_tiles)
        else:
            record(stage_tasks.encode(run, model, attempt))
            denoised = _tiles(run, model, plan, record, attempt, progress)
            record(stage_tasks.blend(run, attempt))
            record(stage_tasks.mux(run, attempt))
        record(stage_tasks.publish(run, str(destination)))

    # The store says what this attempt computed: a tile Dask recomputed after a worker died is counted, once.
    computed = store.tiles_computed(attempt)
    timings = clock.task_seconds()
    summary = ClipSummary(
        source=prepared.source,
        output=str(destination),
        run_key=run.run_key,
        store=str(store.path),
        log=str(store.log_path),
        frames=plan.num_frames,
        fps=plan.fps,
        size=(plan.delivery_size[1], plan.delivery_size[0]),
        tiles_total=plan.num_tiles,
        tiles_computed=computed,
        tiles_reused=plan.num_tiles - computed,
        dit_calls=sum(result.dit_calls for result in denoised),
        timings={stage: round(seconds, 3) for stage, seconds in timings.items()},
        reused_output=store.attempt_of("mux") != attempt,
    )
    _report(store, summary, clock)
    return summary


def _tiles(
    run: RunRef,
    model: ModelSpec,
    plan: ClipPlan,
    record: Callable[[StageResult], StageResult],
    attempt: str,
    progress: artifacts.TileProgress,
) -> list[StageResult]:
    """Denoise every chunk and decode every tile concurrently; a decode waits only for its own chunk."""
    _check_workers()
    chunk_futures = {
        stage_tasks.denoise.submit(run, model, chunk.index, attempt, "-".join(map(str, chunk.tiles))): chunk
        for chunk in plan.chunks
    }
    by_chunk = {chunk.index: future for future, chunk in chunk_futures.items()}
    decode_futures = {
        stage_tasks.decode.submit(run, model, tile, attempt, wait_for=[by_chunk[plan.chunk_of(tile).index]]): tile
        for tile in range(plan.num_tiles)
    }
    denoised, failures, decode_errors = [], {}, {}
    decoded = 0
    # Every task is recorded as it ends, so the stage clock sees when each one finished.
    for future in as_completed([*chunk_futures, *decode_futures]):
        try:
            result = record(future.result())
        except Exception as err:  # noqa: BLE001 - collected and reported per tile below
            message = f"{type(err).__name__}: {err}"
            if future in decode_futures:
                decode_errors[decode_futures[future]] = message
            else:
                # A failed chunk's decodes only report that they never ran; the chunk's error is the cause.
                failures.update({tile: message for tile in chunk_futures[future].tiles})
            continue
        if future in decode_futures:
            decoded += 1
            progress.update(decoded)
        else:
            denoised.append(result)
    for tile, message in decode_errors.items():
        failures.setdefault(tile, message)
    if failures:
        detail = "; ".join(f"tile {tile}: {message}" for tile, message in sorted(failures.items()))
        raise TileFailure(
            f"run {run.run_key}: {len(failures)} of {plan.num_tiles} tiles failed after retries ({detail}); "
            "finished tiles are kept, rerun the same command to resume"
        )
    return denoised


def _report(store: RunStore, summary: ClipSummary, clock: StageClock) -> None:
    """The run's report artifact: before/after still, stage spans, tiles, workers, output; never fails a run."""
    try:
        # Only the middle frame of each is read: verifying the whole clip again would cost seconds per run.
        middle = summary.frames // 2
        before = store.preview("frames", middle, stage="ingest")
        after = store.preview("video", middle, stage="blend")
        if before is None or after is None:
            return
        output = Path(summary.output).resolve()
        report = artifacts.ClipReport(
            source=summary.source,
            run_key=summary.run_key,
            frames=summary.frames,
            fps=summary.fps,
            before=before,
            after=after,
            stages=clock.spans(),
            run_seconds=clock.elapsed(),
            tiles_total=summary.tiles_total,
            tiles_computed=summary.tiles_computed,
            tiles_reused=summary.tiles_reused,
            workers=artifacts.workers_in_use(),
            output=str(output),
            output_bytes=output.stat().st_size,
            store=summary.store,
            reused_output=summary.reused_output,
        )
        artifacts.publish_clip_report(report, flow_run.id)
    except Exception as err:  # noqa: BLE001
        get_run_logger().warning("could not publish the report artifact: %s", err)
