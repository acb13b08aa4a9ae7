"""Where a clip run stands, read from its completion records alone: the stage, the window, the tiles decoded.

The terminal's bar and the Prefect UI's progress artifact both say `RunProgress.text()`, so they never disagree, and
both work whichever processes compute (threads, Dask workers, warm workers) and count what a resumed run had already
finished. Stages overlap (window 2 encodes while window 1 decodes): the stage named is that of the earliest window
not yet through it, which is what holds the run back.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from pydantic import BaseModel

from k6vsr_core.contract.plan import ClipPlan
from k6vsr_core.contract.stage_names import CPU_STAGES, Stage
from k6vsr_core.errors import StoreError
from storage.run_store import RunStore

SEPARATOR = " · "
# The stages whose records say where a run stands (the output's own record says the rest).
PROGRESS_STAGES = (Stage.INGEST, Stage.ENCODE, Stage.DENOISE, Stage.DECODE, *CPU_STAGES)


@dataclass(frozen=True)
class RunProgress:
    stage: str  # a stage of the pipeline (flows.stage_clock.PIPELINE), or "done"
    window: int  # from 0
    windows: int
    decoded: int  # (window, tile) items decoded, of every window
    total: int

    def where(self) -> str:
        """`decode · window 2 of 3`; the stage alone for a clip of one window, or once the run is done."""
        if self.windows > 1 and self.stage != "done":
            return f"{self.stage}{SEPARATOR}window {self.window + 1} of {self.windows}"
        return self.stage

    def text(self) -> str:
        """`decode · window 2 of 3 · 7 of 18 tiles`."""
        return f"{self.where()}{SEPARATOR}{self.decoded} of {self.total} tile{'s' * (self.total != 1)}"


def read_progress(store: RunStore, plan: ClipPlan, paces: Mapping[str, float] | None = None) -> RunProgress:
    """The run's progress now. Publishing writes no record: once the joined output is recorded, the run publishes.
    `paces`: seconds per item by stage, as far as timed (`ProgressCounter.progress`)."""
    return ProgressCounter(store, plan).progress(paces)


class ProgressCounter:
    """A run's progress, read from its records once and then kept from the stages its flow sees end: redrawing the
    progress after every task lists no records (`finished` adds what the records would now hold)."""

    def __init__(self, store: RunStore, plan: ClipPlan) -> None:
        self.plan = plan
        self.output_done = store.output_done()
        self.done = {stage: set(store.records.items(stage)) for stage in PROGRESS_STAGES}
        self.seconds: dict[str, list[float]] = {}  # the seconds of the items seen computed, by stage

    def finished(self, stage: Stage, window: int, tiles: tuple[int, ...] = (), seconds: float = 0.0) -> None:
        """`stage` of `window` (of those `tiles`, for a stage per tile) is recorded done, after `seconds` of work
        (0 when it found its work done)."""
        if seconds > 0:
            self.seconds.setdefault(stage, []).append(seconds)
        if stage in (Stage.DENOISE, Stage.DECODE):
            self.done[stage].update(f"{window}-{tile}" for tile in tiles)
        elif stage in PROGRESS_STAGES:
            self.done[stage].add("all" if stage == Stage.INGEST else str(window))
        elif stage == Stage.MUX:
            self.output_done = True

    def progress(self, paces: Mapping[str, float] | None = None) -> RunProgress:
        """Where the run stands. In a window whose denoises and decodes are both left, the stage named is the one
        with more seconds left at `paces` (seconds per item by stage; those `finished` was told of by default):
        a decode may take ten times a denoise. Until both are timed, the denoise, which comes first."""
        plan, done = self.plan, self.done
        if paces is None:
            paces = {stage: sum(seconds) / len(seconds) for stage, seconds in self.seconds.items()}
        decoded = [0] * plan.num_windows
        for item in done[Stage.DECODE]:
            window = int(item.split("-", 1)[0])
            if window < plan.num_windows:
                decoded[window] += 1
        total = plan.num_windows * plan.num_tiles

        def at(stage: str, window: int = 0) -> RunProgress:
            return RunProgress(stage, window, plan.num_windows, min(total, sum(decoded)), total)

        if self.output_done:
            return at(Stage.PUBLISH, plan.num_windows - 1)
        if "all" not in done[Stage.INGEST]:
            return at(Stage.INGEST)
        tiling = next((w for w, count in enumerate(decoded) if count < plan.num_tiles), None)
        if tiling is not None:
            if str(tiling) not in done[Stage.ENCODE]:
                return at(Stage.ENCODE, tiling)
            denoised = {item for item in done[Stage.DENOISE] if item.split("-", 1)[0] == str(tiling)}
            if len(denoised) >= plan.num_tiles:
                return at(Stage.DECODE, tiling)
            chunks = sum(1 for c in plan.chunks if any(f"{tiling}-{tile}" not in denoised for tile in c.tiles))
            denoising = chunks * paces.get(Stage.DENOISE, 0.0)  # a chunk's denoise is one task
            decoding = (plan.num_tiles - decoded[tiling]) * paces.get(Stage.DECODE, 0.0)
            return at(Stage.DECODE if decoding > denoising > 0 else Stage.DENOISE, tiling)
        for stage in CPU_STAGES:
            waiting = next((w for w in range(plan.num_windows) if str(w) not in done[stage]), None)
            if waiting is not None:
                return at(stage, waiting)
        return at(Stage.MUX, plan.num_windows - 1)


def run_finished(plan: ClipPlan) -> RunProgress:
    """A run whose output is published."""
    total = plan.num_windows * plan.num_tiles
    return RunProgress("done", plan.num_windows - 1, plan.num_windows, total, total)


def stored_plan(store: RunStore) -> ClipPlan | None:
    """The plan the run's ingest recorded, which the run follows; None before it is written."""
    try:
        return store.read_manifest().plan
    except (OSError, ValueError, StoreError):  # not written yet, or unreachable: nothing to show yet
        return None


def clips_text(done: int, failed: int, left: int) -> str:
    """`clips: 1 done, 0 failed, 2 left`."""
    return f"clips: {done} done, {failed} failed, {left} left"


def clip_text(name: str, progress: RunProgress | None) -> str:
    """`b.mp4: decode · window 2 of 3 · 7 of 18 tiles`; `b.mp4: ingest` before the clip's plan is recorded."""
    return f"{name}: {Stage.INGEST if progress is None else progress.text()}"


class StageCount(BaseModel):
    """Of a stage's items in a run: those this attempt computed, and those it found done."""

    computed: int
    reused: int

    def text(self) -> str:
        return f"{self.computed} computed, {self.reused} reused"


def stage_items(plan: ClipPlan) -> dict[Stage, list[str]]:
    """The record items each recorded stage has in a run of `plan`, in pipeline order (publishing records none)."""
    windows = [str(w) for w in range(plan.num_windows)]
    tiles = [f"{w}-{t}" for w in range(plan.num_windows) for t in range(plan.num_tiles)]
    return {
        Stage.INGEST: ["all"],
        Stage.ENCODE: windows,
        Stage.DENOISE: tiles,
        Stage.DECODE: tiles,
        Stage.BLEND: windows,
        Stage.SEGMENT: windows,
        Stage.MUX: ["all"],
    }


def stage_counts(store: RunStore, plan: ClipPlan, attempt: str) -> dict[Stage, StageCount]:
    """Per stage, how many of its items `attempt` computed and how many it reused, from the run's timeline."""
    computed = store.records.computed(attempt)
    counts: dict[Stage, StageCount] = {}
    for stage, items in stage_items(plan).items():
        done = len(computed.get(stage, set()) & set(items))
        counts[stage] = StageCount(computed=done, reused=len(items) - done)
    return counts


def tile_count(counts: Mapping[Stage, StageCount]) -> StageCount:
    """The run's (window, tile) items, as its summary, the archive's manifest, an HTTP job and the report artifact
    count them: a tile is computed when this attempt decoded it (its last stage; the bar counts decoded tiles too),
    reused when it found it decoded. The stages before it have counts of their own (`stage_counts`): a run resumed
    in a window's decode reuses every denoised tile of it and computes the decodes left."""
    return counts[Stage.DECODE]


@contextmanager
def polling(show: Callable[[], None], name: str, every_s: float) -> Iterator[None]:
    """`show()` every `every_s` seconds on a thread of its own while the block runs (the terminal's bars and the
    archive's Prefect artifact alike). The thread runs in a copy of this context: Prefect's settings, the API's
    address among them, may live in context variables."""
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(every_s):
            show()

    thread = threading.Thread(target=contextvars.copy_context().run, args=(poll,), name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
