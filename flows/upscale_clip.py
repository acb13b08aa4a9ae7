"""The clip flow: ingest, then per window: encode -> denoise per tile chunk -> decode per tile -> blend -> segment ->
the window's part of the quality report (these three one task, `blend-segment`); then mux (join the segments) ->
publish -> the quality report (the parts joined).

Every stage is persisted in the run store per (window, tile), so a crash, a killed worker or a bad tile costs only
the unfinished work: the next run of the same clip and parameters finds the finished items by their records and
skips them. Windows flow through the store one after another: a window's segment is written (and its intermediates
deleted) while later windows are on the GPU.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel

from flows import artifacts, clip_context
from flows.run_log import run_log
from flows.stage_clock import StageClock
from k6vsr_core import media, settings
from k6vsr_core.contract.params import output_name
from k6vsr_core.contract.plan import ClipPlan
from k6vsr_core.contract.quality import QualityReport
from k6vsr_core.contract.stage_names import Stage, TaskKind
from k6vsr_core.errors import TileFailure, WindowStopped
from runtime.flow_leases import LEASE_HOOKS, leased
from runtime.lanes import SubmitTask, lanes_for, shared_queues
from runtime.runners import is_dask_runner, local_threads
from runtime.schedule import Item, Scheduler, clip_graph
from runtime.service_errors import WorkersUnavailable
from service.runs import ModelSpec, PreparedRun, RunRef
from storage import RunStore, StoreUnreachable
from storage.disk import DiskFull, disk_full, is_no_space
from storage.location import is_url
from storage.progress import ProgressCounter, StageCount, read_progress, run_finished, stage_counts, tile_count
from tasks import ingest as ingest_tasks
from tasks import quality as quality_tasks
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
    windows: int
    output_format: dict[str, Any]  # codec, crf, preset, pix_fmt, container, audio, exact frame rate
    size: tuple[int, int]  # (width, height) of the written video
    tiles_total: int
    tiles_computed: int
    tiles_reused: int
    dit_calls: int
    timings: dict[str, float]  # busy seconds: each stage's task times added up (tasks overlap: more than the run)
    spans: dict[str, float] = {}  # wall-clock seconds from each stage's first start to its last end
    items: dict[str, StageCount] = {}  # per stage: the items this attempt computed and those it reused
    reused_output: bool
    quality: QualityReport | None = None  # the output's quality report (tasks.quality); None for a latent run


# The progress artifact is updated at most this often, and at the run's end: each update is a request to the Prefect
# API (flows.artifacts.TileProgress).
PROGRESS_EVERY_S = 5.0


def _check_workers(model: ModelSpec) -> None:
    """With process workers, one trivial task, which also checks the model's weights, must complete before tiles
    are sent."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or not is_dask_runner(context.task_runner):
        return
    # Long enough for a cluster of GPU workers to start and import torch; a worker that cannot import k6vsr would
    # otherwise be restarted by Dask forever and the run would hang instead of failing.
    ready_s = settings.read(settings.Workers).workers_ready_timeout
    future = stage_tasks.workers_ready.submit(model)
    future.wait(timeout=ready_s)
    if future.state.is_failed():
        future.result()  # the worker's own error, e.g. a model whose weights do not match it
    if not future.state.is_completed():
        raise WorkersUnavailable(
            f"no Dask worker ran a trivial k6vsr task within {ready_s:g} s "
            f"(state {future.state.name}): check that k6vsr is installed where the workers run and that they "
            "started (K6VSR_WORKERS_READY_TIMEOUT sets the wait)"
        )


def _attempt_id() -> str:
    """The name this attempt writes into every record it makes: its flow-run id, else a fresh one."""
    return flow_run.id or uuid.uuid4().hex


def _flow_run_name() -> str:
    """The run context's name, else `upscale-<source's file name>`."""
    named = clip_context.current().name
    if named:
        return named
    prepared = flow_run.parameters.get("prepared")
    if prepared is None:  # the request flow names its run after the source it was given
        source = flow_run.parameters.get("source", "clip")
    else:  # a PreparedRun, or its JSON when the run was created through the API
        source = prepared.source if isinstance(prepared, PreparedRun) else prepared.get("source", "clip")
    return f"upscale-{Path(str(source)).name}"


def clip_flow(name: str) -> Any:
    """The flow decorator of the clip flows (this one, and the deployment's `flows.orchestrate.upscale_request`).
    Their default runner is this process's threads: `run_clip` (flows.orchestrate) picks where a clip's tiles
    compute and runs it there."""
    return flow(
        name=name,
        flow_run_name=_flow_run_name,
        log_prints=False,
        validate_parameters=True,
        task_runner=local_threads(),
        **LEASE_HOOKS,
    )


@clip_flow("upscale-clip")
@leased  # a run whose process is killed is marked Crashed by the next command
def upscale_clip(prepared: PreparedRun, output: str | None = None, model: ModelSpec = ModelSpec()) -> ClipSummary:
    """Upscale one planned clip into `output` (a file path; default: `<stem>_sr<scale>x_<timestamp>.mp4` beside it).

    `prepared` is the plan its caller made of this clip (`service.runs.prepare_run`): the flow hands it to ingest,
    which records it in the manifest (re-planned only if fewer frames decode than the probe counted); every later
    stage reads it from there. A latent run's `prepared.latent_fps` is set: its source is a safetensors file of one
    unscaled KVAE latent `[T, C, H, W]` (`k6vsr_core.contract.latent`), its encode stage reads the latent instead of
    frames.
    """
    clock = StageClock()
    logger = get_run_logger()
    run, source = prepared.run, prepared.source
    store = run.open()
    destination = (
        Path(output) if output else Path(source).parent / output_name(source, prepared.plan.params, datetime.now())
    )
    published = output if output and is_url(output) else str(destination)  # a path would mangle a URL

    def record(result: StageResult) -> StageResult:
        clock.finished(result.stage, result.seconds, result.ends_before)
        return result

    attempt = _attempt_id()
    with _full_disk_named(store), store.in_use(), store.log_file(attempt) as log_file, run_log(log_file, attempt):
        frames, windows = prepared.plan.num_frames, prepared.plan.num_windows
        logger.info(
            "run %s: %d frame%s in %d window%s of %d tiles, store %s",
            run.run_key,
            frames,
            "s" * (frames != 1),
            windows,
            "s" * (windows != 1),
            prepared.plan.num_tiles,
            store.where,
        )
        ingested = ingest_tasks.ingest(prepared, attempt)
        record(ingested)
        plan = ingested.plan
        total = plan.num_tiles * plan.num_windows
        progress = artifacts.TileProgress(
            prepared.source, run.run_key, flow_run.id, read_progress(store, plan), PROGRESS_EVERY_S
        )
        denoised: list[StageResult] = []
        if not store.output_done():
            denoised = _windows(run, model, plan, record, attempt, progress, ProgressCounter(store, plan), store)
            record(stage_tasks.mux(run, attempt))
            progress.update(read_progress(store, plan))
        record(stage_tasks.publish(run, published))
        progress.finish(run_finished(plan))
        quality = quality_tasks.measure_quality(run, attempt)

    # The run's timeline says what this attempt computed: a tile Dask recomputed after a worker died counts once.
    counts = stage_counts(store, plan, attempt)
    tiles = tile_count(counts)
    timings = clock.task_seconds()
    summary = ClipSummary(
        source=prepared.source,
        output=published,
        run_key=run.run_key,
        store=str(store.where),
        log=str(store.log_location(attempt)),
        frames=plan.num_frames,
        fps=plan.fps,
        windows=plan.num_windows,
        output_format=plan.output_format(),
        size=(plan.delivery_size[1], plan.delivery_size[0]),
        tiles_total=total,
        tiles_computed=tiles.computed,
        tiles_reused=tiles.reused,
        dit_calls=sum(result.dit_calls for result in denoised),
        timings={stage: round(seconds, 3) for stage, seconds in timings.items()},
        spans={span.stage: round(span.span, 3) for span in clock.spans()},
        items=counts,
        reused_output=store.attempt_of(Stage.MUX) != attempt,
        quality=quality,
    )
    _report(store, summary, clock, plan)
    return summary


@contextmanager
def _full_disk_named(store: RunStore) -> Iterator[None]:
    """A write that found no room, wherever it was, fails the run once with the store's disk named (an error that
    names its own file, as a failed publish's names the output, is left as it is)."""
    try:
        yield
    except Exception as err:
        if is_no_space(err) and not isinstance(err, DiskFull) and not getattr(err, "filename", None):
            raise disk_full(tempfile.gettempdir() if store.remote else store.path, err) from err
        raise


def _windows(
    run: RunRef,
    model: ModelSpec,
    plan: ClipPlan,
    record: Callable[[StageResult], StageResult],
    attempt: str,
    progress: artifacts.TileProgress,
    counter: ProgressCounter,
    store: RunStore,
) -> list[StageResult]:
    """Every window's tasks, each started when its inputs are in, model work most urgent first and blends and
    segments beside it (runtime.schedule), so windows stream through the store one after another."""
    _check_workers(model)
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    denoised: list[StageResult] = []
    failures: dict[tuple[int, int], str] = {}  # (window, tile or -1 for the window's own stages) -> cause
    unreachable: StoreUnreachable | None = None  # the store, not a tile, is at fault: said once, not per tile
    full: BaseException | None = None  # so is its disk
    with lanes_for(context.task_runner if context else None) as lanes:
        get_run_logger().info("lanes: %s", lanes.where)

        def start(lane: SubmitTask) -> Callable[[Item], Any]:
            return lambda item: lane(*_task_of(item, run, model, attempt))

        clip_run = clip_context.current()
        model_slots, cpu_slots = shared_queues(lanes, clip_run.queue)
        graph = clip_graph(plan, stream_blend=lanes.stream_blend, fused=lanes.fuses(plan))
        scheduler = Scheduler(graph, start(lanes.model), start(lanes.cpu), model_slots, clip_run.rank, cpu_slots)
        finished = False
        try:
            # Every task is recorded as it ends, so the stage clock sees when each one finished.
            for item, future in scheduler.run():
                try:
                    outcome = future.result()
                except Exception as err:  # noqa: BLE001 - collected and reported per (window, tile) below
                    scheduler.failed(item)
                    if item.on_model:
                        _stop_blends(store, [item.window], attempt)
                    if isinstance(err, StoreUnreachable):
                        unreachable = err
                    if is_no_space(err):
                        full = err
                    if isinstance(err, WindowStopped):
                        continue  # a blend told that a tile it waited for failed: that tile's failure says why
                    message = f"{type(err).__name__}: {err}"
                    for key in [(item.window, tile) for tile in item.tiles] or [(item.window, -1)]:
                        failures.setdefault(key, message)
                    continue
                # A task of several stages (denoise-decode, blend-segment) returns a result per stage it ran.
                for result in outcome if isinstance(outcome, list) else [outcome]:
                    record(result)
                    # Each task's end may move the run to its next stage: counted from its result, not re-read.
                    counter.finished(result.stage, result.window, result.tiles, result.seconds)
                    if result.stage == Stage.DENOISE:
                        denoised.append(result)
                progress.update(counter.progress())
            finished = True
        finally:
            if not finished:  # interrupted: a blend still waiting on a worker must not wait for ever
                _stop_blends(store, range(plan.num_windows), attempt)
    if unreachable is not None:
        raise unreachable
    if full is not None:
        raise full
    if failures:
        raise TileFailure(_failure_message(run, plan, failures))
    return denoised


def _stop_blends(store: RunStore, windows: Iterable[int], attempt: str) -> None:
    """Tell the blends waiting for these windows' tiles that some will not come. Best effort: a blend that does not
    hear it (the store unreachable) gives up after `K6VSR_BLEND_WAIT` seconds without a tile."""
    with suppress(Exception):
        for window in windows:
            store.stop_window(window, attempt)


def _task_of(item: Item, run: RunRef, model: ModelSpec, attempt: str) -> tuple[Any, dict[str, Any]]:
    """The stage task that computes `item`, with its parameters."""
    w = item.window
    if item.stage == TaskKind.ENCODE:
        return stage_tasks.encode, dict(run=run, model=model, window=w, attempt=attempt)
    if item.stage in (TaskKind.DENOISE, TaskKind.DENOISE_DECODE):
        label = "-".join(map(str, item.tiles))
        parameters = dict(run=run, model=model, window=w, chunk_index=item.index, attempt=attempt, tiles_label=label)
        return stage_tasks.denoise if item.stage == TaskKind.DENOISE else stage_tasks.denoise_decode, parameters
    if item.stage == TaskKind.DECODE:
        return stage_tasks.decode, dict(run=run, model=model, window=w, tile=item.index, attempt=attempt)
    if item.stage == TaskKind.BLEND:  # a preview's (flows.preview)
        return stage_tasks.blend, dict(run=run, window=w, attempt=attempt)
    return stage_tasks.blend_segment, dict(run=run, window=w, attempt=attempt)


# The still compares a frame of the first window: reaching it decodes at most this many frames of the output.
PREVIEW_FRAME = 60


def _failure_message(run: RunRef, plan: ClipPlan, failures: dict[tuple[int, int], str]) -> str:
    def label(window: int, tile: int) -> str:
        where = f"window {window} " if plan.num_windows > 1 or tile < 0 else ""
        return where + (f"tile {tile}" if tile >= 0 else "(blend or segment)")

    tiles = sum(1 for _, tile in failures if tile >= 0)
    detail = "; ".join(f"{label(w, t)}: {message}" for (w, t), message in sorted(failures.items()))
    return (
        f"run {run.run_key}: {tiles} of {plan.num_windows * plan.num_tiles} tiles failed after retries ({detail}); "
        "finished tiles are kept, rerun the same command to resume"
    )


def _source_still(store: RunStore, source: str, plan: ClipPlan, frame: int) -> np.ndarray | None:
    """The source frame shown as the output's `frame`; None for a latent run, which has no source frames."""
    if store.read_manifest().latent_fps is not None:
        return None
    pts = store.get("frame_pts", stage=Stage.INGEST)
    pts = pts if pts is not None and len(pts) else None
    return media.read_frames(source, [plan.source_indices()[frame]], pts, plan.deinterlace)[0]


def _report(store: RunStore, summary: ClipSummary, clock: StageClock, plan: ClipPlan) -> None:
    """The run's report artifact: before/after still, stage spans, tiles, workers, output; never fails a run."""
    try:
        frame = min(summary.frames // 2, PREVIEW_FRAME)
        remote = is_url(summary.output)
        output = summary.output if remote else Path(summary.output).resolve()
        before = _source_still(store, summary.source, plan, frame)
        # An output URL holds the store's output, byte for byte: read from there, it needs no download of its own.
        with store.output_path.fetch() if remote else nullcontext(Path(output)) as file:
            after = media.read_frames(file, [frame])[0]
            output_bytes = file.stat().st_size
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
            items=summary.items,
            workers=artifacts.workers_in_use(),
            output=str(output),
            output_bytes=output_bytes,
            store=summary.store,
            reused_output=summary.reused_output,
            quality=summary.quality,
        )
        artifacts.publish_clip_report(report, flow_run.id)
    except Exception as err:  # noqa: BLE001
        get_run_logger().warning("could not publish the report artifact: %s", err)
