"""The preview flow: a few representative windows of a clip, upscaled before the whole run is started.

It runs the clip's own tasks (ingest, then encode, denoise, decode and blend of each chosen window) through the
run's own scheduler and lanes (`runtime.schedule`: as many model tasks at once as a run computes, the next window
encoded while the one before it is denoised), on the clip's own run store, under the same run key: the whole run
(`k6vsr upscale` with the same parameters) finds those windows blended and computes only the others. It stops short
of the segments, which need each window's neighbour.

It writes a side-by-side MP4 (the bicubic-upscaled source on the left, the output on the right, window after
window) and a contact sheet PNG (the middle frame of each window, source and output), and, from its wall clock over
the frames its windows computed, estimates the whole run's time and disk on this machine
(`storage.estimate.run_estimate`). The wall clock, not the sum of the tasks' seconds: a run computes two model
tasks at once (`runtime.slots.MODEL_SLOTS`) and encodes a window while the one before it decodes, and a sum of tasks
computed one at a time counted that overlapped work in full. The rates are kept in the store (`preview.json`), where
`k6vsr plan` finds them and says the same estimate, from the same function.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from prefect import flow
from pydantic import BaseModel

from flows.upscale_clip import _task_of
from k6vsr_core import media
from k6vsr_core.contract.plan import ClipPlan, representative_windows
from k6vsr_core.contract.stage_names import Stage, TaskKind
from k6vsr_core.errors import MissingInput
from runtime.lanes import SubmitTask, lanes_for, shared_queues
from runtime.runners import local_threads
from runtime.schedule import MODEL_ITEMS, Graph, Item, Scheduler, clip_graph
from service.runs import ModelSpec, PreparedRun, RunRef
from storage import RunStore
from storage.estimate import RATES, RunEstimate, StageRates, read_rates, run_estimate
from tasks import ingest as ingest_tasks
from tasks import stage_tasks
from tasks.descriptors import StageResult

HALF_WIDTH = 960  # each half of the side-by-side at most this wide: a 4K preview stays a small file
SHEET_HALF_WIDTH = 480


class PreviewSummary(BaseModel):
    source: str
    run_key: str
    windows: list[int]  # the windows previewed
    frames: list[tuple[int, int]]  # their kept frames [start, stop)
    side_by_side: str
    contact_sheet: str
    rates: StageRates | None  # None when every chosen window was already in the store and no rate was kept
    estimate: RunEstimate | None


def _flow_run_name() -> str:
    """`preview-<file name>`, as a clip run is `upscale-<file name>`: the Prefect UI tells the two apart."""
    from prefect.runtime import flow_run

    prepared = flow_run.parameters.get("prepared")
    source = prepared.source if isinstance(prepared, PreparedRun) else (prepared or {}).get("source", "clip")
    return f"preview-{Path(str(source)).name}"


@flow(
    name="preview-clip",
    flow_run_name=_flow_run_name,
    log_prints=False,
    validate_parameters=True,
    task_runner=local_threads(),  # the command picks its own (`tile_runner`)
)
def preview_clip(
    prepared: PreparedRun, model: ModelSpec, count: int, out_dir: str, command_started: float | None = None
) -> PreviewSummary:
    """Upscale `count` representative windows of the planned clip into its run store, write the side-by-side MP4
    and the contact sheet into `out_dir`, and estimate the whole run from the rates measured (or kept by an earlier
    preview, when every window chosen was already computed). `command_started` (wall clock) is when the command
    that asked began: the head before this flow's work, which the run's own command pays too."""
    head_s = max(0.0, time.time() - command_started) if command_started is not None else 0.0
    run = prepared.run
    store = run.open()
    attempt = uuid.uuid4().hex
    with store.in_use():
        ingested = ingest_tasks.ingest(prepared, attempt)
        plan = ingested.plan
        chosen = representative_windows(plan, count)
        measured = _windows(run, model, plan, chosen, attempt, store)
        pieces = [(window, _window_frames(store, plan, window)) for window in chosen]
        stem = Path(prepared.source).stem
        side_by_side, sheet = Path(out_dir) / f"{stem}_preview.mp4", Path(out_dir) / f"{stem}_preview.png"
        segment_s_per_frame, bytes_per_frame = _encoding_rate(
            Path(out_dir), plan, np.concatenate([frames for _, frames in pieces])
        )
        halves = [_halves(store, plan, window, frames) for window, frames in pieces]
        _write_side_by_side(side_by_side, plan, halves)
        _write_contact_sheet(sheet, halves)
        rates = read_rates(store)
        if measured:
            rates = StageRates(
                command_head_s=round(head_s, 2),
                ingest_s=ingested.seconds if ingested.computed else (rates.ingest_s if rates else 0.0),
                model_s_per_frame=model_rate(measured),
                segment_s_per_frame=segment_s_per_frame,
                encoded_bytes_per_frame=bytes_per_frame,
                windows_measured=len(measured),
            )
            _keep_rates(store, rates, attempt)
    return PreviewSummary(
        source=prepared.source,
        run_key=run.run_key,
        windows=list(chosen),
        frames=[(plan.windows[w].start, plan.windows[w].stop) for w in chosen],
        side_by_side=str(side_by_side),
        contact_sheet=str(sheet),
        rates=rates,
        estimate=run_estimate(store, plan),
    )


def model_rate(measured: list[tuple[float, int]]) -> float:
    """Model seconds per computed frame from the (seconds, frames) of the windows computed, each window's seconds
    counted from the end of the one before it: the preview's wall clock over the frames it computed, its windows
    computed as a run computes them, so work a run overlaps (two windows' decodes at once) is counted once.

    Not a rate from the windows after the first: two windows whose model work ran side by side end together, and
    the second's few seconds say nothing of a run's pace, which is two windows at a time at most. The seconds in
    which every model task was compiling kernels are already left out (`compile_stall`): a cold compile took half of
    a one-window preview's window on an H100 (2026-12-06, bench/RESULTS.md), and the run after it compiles nothing.
    With one window there is no overlap to see, and the rate is an upper bound."""
    return sum(seconds for seconds, _ in measured) / sum(frames for _, frames in measured)


def preview_graph(plan: ClipPlan, chosen: tuple[int, ...], stream_blend: bool = True, fused: bool = False) -> Graph:
    """The clip's graph (`runtime.schedule.clip_graph`) cut down to the chosen windows' model work and blends, each
    chosen window encoded once the one chosen before it is being denoised, as a run encodes one window ahead."""
    whole = clip_graph(plan, stream_blend, segments=False, fused=fused)
    items = tuple(
        item for item in whole.items if item.window in chosen and item.stage in (*MODEL_ITEMS, TaskKind.BLEND)
    )
    kept = set(items)
    needs = {item: tuple(need for need in whole.needs[item] if need in kept) for item in items}
    after_start = {}
    for before, window in zip(chosen, chosen[1:], strict=False):
        after_start[Item(TaskKind.ENCODE, window, tiles=tuple(range(plan.num_tiles)))] = tuple(
            item
            for item in items
            if item.window == before and item.stage in (TaskKind.DENOISE, TaskKind.DENOISE_DECODE)
        )
    starts_with = {item: first for item, first in whole.starts_with.items() if item in kept}
    return Graph(items, needs, after_start, starts_with)


def _windows(
    run: RunRef, model: ModelSpec, plan: ClipPlan, chosen: tuple[int, ...], attempt: str, store: RunStore
) -> list[tuple[float, int]]:
    """The chosen windows' model work and blends, through the run's own scheduler and lanes (the same model slots,
    so as many tasks at once as the run computes); for each window this preview computed whole, in order, the
    seconds from the previous one's end (or the start) to its own, less the seconds its model work stood compiling
    (`compile_stall`), and the frames it computed (`model_rate`)."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    computed: dict[int, bool] = {window: True for window in chosen}
    ends: dict[int, float] = {}
    work: list[ModelWork] = []
    error: Exception | None = None
    with lanes_for(context.task_runner if context else None) as lanes:
        model_slots, cpu_slots = shared_queues(lanes)

        def start(lane: SubmitTask) -> Callable[[Item], Any]:
            return lambda item: lane(*_task_of(item, run, model, attempt))

        graph = preview_graph(plan, chosen, lanes.stream_blend, lanes.fuses(plan))
        scheduler = Scheduler(graph, start(lanes.model), start(lanes.cpu), model_slots, 0, cpu_slots)
        started = time.time()  # the wall clock: the model stages' spans come from other processes of this host
        for item, future in scheduler.run():
            try:
                outcome: StageResult | list[StageResult] = future.result()
            except Exception as err:  # noqa: BLE001 - the first error is raised once the lanes are idle
                scheduler.failed(item)
                for window in chosen:  # a blend waiting for a tile that will not come
                    store.stop_window(window, attempt)
                error = error or err
                continue
            results = outcome if isinstance(outcome, list) else [outcome]
            computed[item.window] = computed[item.window] and all(result.computed for result in results)
            work += [
                ModelWork(start=r.started_at, end=r.started_at + r.seconds, compiling=r.compile_spans)
                for r in results
                if r.computed and r.started_at and item.stage != TaskKind.BLEND
            ]
            if item.stage == TaskKind.BLEND:
                ends[item.window] = time.time() - started
    if error is not None:
        raise error
    measured, previous = [], 0.0
    for window in sorted(ends, key=ends.__getitem__):
        if computed[window]:
            stalled = compile_stall(work, started + previous, started + ends[window])
            measured.append((ends[window] - previous - stalled, plan.windows[window].padded))
        previous = ends[window]
    return measured


class ModelWork(BaseModel):
    """One model stage's work as the preview saw it: its wall-clock span and the spans inside it that compiled."""

    start: float
    end: float
    compiling: list[tuple[float, float]] = []


def compile_stall(work: list[ModelWork], start: float, end: float) -> float:
    """Seconds of [start, end) in which model work ran and all of it was compiling kernels (or waiting for another
    thread's compile): what a run on this machine, its compile cache now warm, does not pay again. While one task
    compiles and another computes, the compile costs the run nothing: the GPU is busy either way."""
    points = sorted({start, end, *(t for w in work for t in (w.start, w.end, *(x for c in w.compiling for x in c)))})
    stalled = 0.0
    for a, b in zip(points, points[1:], strict=False):
        if b <= start or a >= end:
            continue
        middle = (a + b) / 2
        running = [w for w in work if w.start <= middle < w.end]
        if running and all(any(c0 <= middle < c1 for c0, c1 in w.compiling) for w in running):
            stalled += min(b, end) - max(a, start)
    return stalled


def _window_frames(store: RunStore, plan: ClipPlan, window: int) -> np.ndarray:
    """The window's delivered frames: from the store, or from the finished output once the run has written it."""
    frames = stage_tasks.blended_frames(store, plan, window)
    if frames is not None:
        return frames
    if store.output_done():
        span = plan.windows[window]
        with store.output_path.fetch() as output:
            return media.read_frames(output, list(range(span.start, span.stop)), depth=plan.depth)
    raise MissingInput(
        f"run {store.run_key}: window {window} is already written into its segments; finish the run "
        "(k6vsr upscale with the same parameters) to see it"
    )


def _halves(store: RunStore, plan: ClipPlan, window: int, frames: np.ndarray) -> np.ndarray:
    """Side by side: the source's frames of `window` upscaled bicubically to the output's size (each half at most
    `HALF_WIDTH` wide), and the output."""
    import cv2

    manifest = store.read_manifest()
    pts = store.get("frame_pts", stage=Stage.INGEST)
    originals = media.read_frames(
        store.source_file(manifest),
        plan.source_indices(plan.windows[window]),
        pts if pts is not None and len(pts) else None,
        plan.deinterlace,
    )
    frames = media.eight_bits(frames)  # the side-by-side clip and the sheet are 8-bit, the source read so too
    height, width = frames.shape[1:3]
    scale = min(1.0, HALF_WIDTH / width)
    size = (max(2, round(width * scale / 2) * 2), max(2, round(height * scale / 2) * 2))
    out = np.empty((frames.shape[0], size[1], 2 * size[0], 3), dtype=np.uint8)
    for i, (before, after) in enumerate(zip(originals, frames, strict=True)):
        out[i, :, : size[0]] = cv2.resize(before, size, interpolation=cv2.INTER_CUBIC)
        out[i, :, size[0] :] = cv2.resize(after, size, interpolation=cv2.INTER_AREA) if scale < 1 else after
    return out


def _encoding_rate(folder: Path, plan: ClipPlan, frames: np.ndarray) -> tuple[float, float]:
    """Seconds and bytes of encoding one output frame as the run's segments will: timed on the preview's frames."""
    probe = folder / f".k6vsr-preview-{uuid.uuid4().hex}{plan.encoding.suffix}"
    try:
        started = time.perf_counter()
        media.write_segment(probe, frames, plan.frame_rate, plan.encoding, plan.colour, hdr=plan.hdr)
        return (time.perf_counter() - started) / len(frames), probe.stat().st_size / len(frames)
    finally:
        probe.unlink(missing_ok=True)


def _write_side_by_side(path: Path, plan: ClipPlan, halves: list[np.ndarray]) -> None:
    tmp = path.with_name(f".{path.name}.part.mp4")
    media.write_video(tmp, np.concatenate(halves), plan.frame_rate, None, colour=plan.colour)
    tmp.replace(path)


def _write_contact_sheet(path: Path, halves: list[np.ndarray]) -> None:
    """One row a window: its middle frame, source and output, each half at most `SHEET_HALF_WIDTH` wide."""
    import cv2
    from PIL import Image

    rows = []
    for pair in halves:
        middle = pair[pair.shape[0] // 2]
        width = min(2 * SHEET_HALF_WIDTH, middle.shape[1])
        height = max(1, round(middle.shape[0] * width / middle.shape[1]))
        rows.append(cv2.resize(middle, (width, height), interpolation=cv2.INTER_AREA))
    tmp = path.with_name(f".{path.name}.part.png")
    Image.fromarray(np.concatenate(rows)).save(tmp, format="PNG")
    tmp.replace(path)


def _keep_rates(store: RunStore, rates: StageRates, attempt: str) -> None:
    path = store.where / RATES
    tmp = store.temp_file(path, ".json")
    try:
        tmp.write_text(rates.model_dump_json(indent=2))
        store.commit_file(tmp, path, Stage.PREVIEW, "all", attempt=attempt)
    finally:
        tmp.unlink(missing_ok=True)
