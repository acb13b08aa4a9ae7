"""The order of a clip's tasks (flows.schedule), on lanes that only record what they were asked to run."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from flows.schedule import Item, Scheduler, clip_graph
from k6vsr_core.params import UpscaleParams
from k6vsr_core.plan import ClipPlan, make_plan


def _plan(windows: int) -> ClipPlan:
    """768x512 at x2: 9 tiles of one chunk each; 121 frames a window, 105 more for each window after the first."""
    plan = make_plan((512, 768), 121 + 105 * (windows - 1), 24.0, UpscaleParams(scale=2))
    assert (plan.num_windows, plan.num_tiles, len(plan.chunks)) == (windows, 9, 9)
    return plan


class Lanes:
    """Runs each item in a thread pool after `seconds`, fails those in `failing`, keeps every (lane, item, start,
    end); `at_once` is the most model items that ever ran together."""

    def __init__(self, seconds: float = 0.0, failing: tuple[Item, ...] = ()) -> None:
        self.seconds, self.failing = seconds, failing
        self.log: list[tuple[str, Item, float, float]] = []
        self._pool = ThreadPoolExecutor(max_workers=16)
        self._lock = threading.Lock()
        self._model_running = 0
        self.at_once = 0

    def model(self, item: Item) -> Future:
        return self._pool.submit(self._run, "model", item)

    def cpu(self, item: Item) -> Future:
        return self._pool.submit(self._run, "cpu", item)

    def _run(self, lane: str, item: Item) -> Item:
        with self._lock:
            if lane == "model":
                self._model_running += 1
                self.at_once = max(self.at_once, self._model_running)
        start = time.monotonic()
        time.sleep(self.seconds)
        with self._lock:
            self.log.append((lane, item, start, time.monotonic()))
            self._model_running -= lane == "model"
        if item in self.failing:
            raise RuntimeError(f"{item} failed")
        return item

    def span(self, stage: str, window: int, index: int = 0) -> tuple[float, float]:
        return next((s, e) for _, i, s, e in self.log if (i.stage, i.window, i.index) == (stage, window, index))


def _run(plan: ClipPlan, lanes: Lanes, slots: int) -> list[Item]:
    """Every item the scheduler ran to its end, in the order they finished; failures are told to it."""
    scheduler = Scheduler(clip_graph(plan), lanes.model, lanes.cpu, slots)
    finished = []
    for item, future in scheduler.run():
        if future.exception() is not None:
            scheduler.failed(item)
        finished.append(item)
    return finished


def test_one_model_slot_decodes_each_tile_as_soon_as_its_chunk_is_denoised() -> None:
    lanes = Lanes()
    _run(_plan(2), lanes, slots=1)
    model = [(i.stage, i.window, i.index) for lane, i, _, _ in sorted(lanes.log, key=lambda r: r[2]) if lane == "model"]
    window_0 = [("encode", 0, 0)] + [(stage, 0, n) for n in range(9) for stage in ("denoise", "decode")]
    # The next window's encode comes once its window's last denoise has started: after that denoise's own decode.
    assert model[: len(window_0) + 1] == window_0 + [("encode", 1, 0)]
    assert model[len(window_0) + 1 :] == [(stage, 1, n) for n in range(9) for stage in ("denoise", "decode")]
    assert lanes.at_once == 1


def test_blend_and_segment_overlap_the_next_windows_model_work() -> None:
    lanes = Lanes(seconds=0.02)
    _run(_plan(3), lanes, slots=2)
    assert lanes.at_once == 2
    for window in (0, 1):
        blend, segment = lanes.span("blend", window), lanes.span("segment", window)
        assert {lane for lane, i, _, _ in lanes.log if i.stage in ("blend", "segment")} == {"cpu"}
        # Window k's blend and segment run while window k+1's tiles are still being denoised or decoded.
        next_model_end = max(e for lane, i, _, e in lanes.log if lane == "model" and i.window == window + 1)
        assert blend[0] < next_model_end and segment[0] < next_model_end
        # And neither starts before what it reads exists.
        assert blend[0] >= max(lanes.span("decode", window, t)[1] for t in range(9))
        assert segment[0] >= blend[1]
    first_decode = lanes.span("decode", 0, 0)[0]
    assert first_decode < lanes.span("denoise", 0, 8)[1]


def test_a_failed_tile_stops_only_what_needs_it() -> None:
    failing = (Item("decode", 0, 4, (4,)),)
    lanes = Lanes(failing=failing)
    finished = _run(_plan(2), lanes, slots=2)
    ran = {(i.stage, i.window) for i in finished}
    # Window 0 cannot be blended, so neither its segment nor window 1's (which reads window 0's frames) is made.
    assert ("blend", 0) not in ran and ("segment", 0) not in ran and ("segment", 1) not in ran
    # Everything else is computed, so that a rerun has only that tile and what follows it left.
    assert sum(1 for i in finished if i.window == 1 and i.stage == "decode") == 9
    assert ("blend", 1) in ran


def test_a_window_whose_encode_fails_does_not_hold_back_the_next() -> None:
    lanes = Lanes(failing=(Item("encode", 0, 0, tuple(range(9))),))
    finished = _run(_plan(2), lanes, slots=2)
    assert [i.stage for i in finished if i.window == 0] == ["encode"]
    assert {i.stage for i in finished if i.window == 1} == {"encode", "denoise", "decode", "blend"}


def test_the_model_lane_needs_a_slot() -> None:
    with pytest.raises(ValueError, match="slot"):
        Scheduler(clip_graph(_plan(1)), Lanes().model, Lanes().cpu, slots=0)
