"""The order of a clip's tasks (runtime.schedule), on lanes that only record what they were asked to run."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from k6vsr_core.contract.params import UpscaleParams
from k6vsr_core.contract.plan import ClipPlan, make_plan
from runtime.schedule import Item, ModelQueue, Scheduler, clip_graph


def _plan(windows: int) -> ClipPlan:
    """768x512 at x2: 9 tiles of one chunk each; 121 frames a window, 105 more for each window after the first."""
    plan = make_plan((512, 768), 121 + 105 * (windows - 1), 24.0, UpscaleParams(scale=2))
    assert (plan.num_windows, plan.num_tiles, len(plan.chunks)) == (windows, 9, 9)
    return plan


class Lanes:
    """Runs each item in a thread pool after `seconds`, fails those in `failing`, keeps every (lane, item, start,
    end); `at_once` is the most model items that ever ran together."""

    def __init__(
        self, seconds: float = 0.0, failing: tuple[Item, ...] = (), on_start: Callable[[Item], None] | None = None
    ) -> None:
        self.seconds, self.failing, self.on_start = seconds, failing, on_start
        self.decoded: dict[tuple[int, int], threading.Event] = {}  # set when a decode ends, whether or not it failed
        self.failed: set[Item] = set()
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
        if self.on_start is not None:
            self.on_start(item)
        time.sleep(self.seconds)
        if item.stage in ("blend", "blend-segment"):
            self._wait_for_tiles(item.window)  # as the blend task does: it adds tiles as they are decoded
        with self._lock:
            self.log.append((lane, item, start, time.monotonic()))
            self._model_running -= lane == "model"
        if item.stage in ("decode", "denoise-decode"):
            for tile in item.tiles:
                self._decoded(item.window, tile).set()
        if item in self.failing:
            raise RuntimeError(f"{item} failed")
        return item

    def _decoded(self, window: int, tile: int) -> threading.Event:
        with self._lock:
            return self.decoded.setdefault((window, tile), threading.Event())

    def _wait_for_tiles(self, window: int) -> None:
        for tile in range(9):
            self._decoded(window, tile).wait()
            if Item("decode", window, tile, (tile,)) in self.failing:
                raise RuntimeError(f"window {window}: tile {tile} will not come")

    def span(self, stage: str, window: int, index: int = 0) -> tuple[float, float]:
        return next((s, e) for _, i, s, e in self.log if (i.stage, i.window, i.index) == (stage, window, index))


def _run(plan: ClipPlan, lanes: Lanes, slots: int, fused: bool = False) -> list[Item]:
    """Every item the scheduler ran to its end, in the order they finished; failures are told to it (and kept in
    `lanes.failed`)."""
    scheduler = Scheduler(clip_graph(plan, fused=fused), lanes.model, lanes.cpu, slots)
    finished = []
    for item, future in scheduler.run():
        if future.exception() is not None:
            scheduler.failed(item)
            lanes.failed.add(item)
        finished.append(item)
    return finished


def test_one_model_slot_decodes_each_tile_as_soon_as_its_chunk_is_denoised() -> None:
    lanes = Lanes()
    _run(_plan(2), lanes, slots=1)
    model = [(i.stage, i.window, i.index) for lane, i, _, _ in sorted(lanes.log, key=lambda r: r[2]) if lane == "model"]
    window_0 = [("encode", 0, 0)] + [(stage, 0, n) for n in range(9) for stage in ("denoise", "decode")]
    # The next window's encode is ready once its window's last denoise but one has started, and an encode goes
    # first: right after that denoise, so it is encoded while the window's last chunk is still to compute.
    penultimate = window_0.index(("denoise", 0, 7)) + 1
    assert model[: len(window_0) + 1] == [*window_0[:penultimate], ("encode", 1, 0), *window_0[penultimate:]]
    assert model[len(window_0) + 1 :] == [(stage, 1, n) for n in range(9) for stage in ("denoise", "decode")]
    assert lanes.at_once == 1


def test_a_window_is_its_model_items_and_one_cpu_item() -> None:
    """A window of 9 tiles (9 chunks) is 9 + 9 + 2 task runs: its encode, a denoise per chunk, a decode per tile and
    one blend-segment (its blend, segment and part of the quality report), which needs the window before's."""
    graph = clip_graph(_plan(2))
    for window in (0, 1):
        stages = [i.stage for i in graph.items if i.window == window]
        assert stages == ["encode", *["denoise"] * 9, *["decode"] * 9, "blend-segment"]
    second = Item("blend-segment", 1)
    assert Item("blend-segment", 0) in graph.needs[second]
    assert graph.needs_to_start(second) == (Item("decode", 1, 0, (0,)), Item("blend-segment", 0))
    # A preview blends alone, each window on its own.
    preview = clip_graph(_plan(2), segments=False)
    assert [i.stage for i in preview.items if i.stage not in ("encode", "denoise", "decode")] == ["blend", "blend"]
    assert preview.needs_to_start(Item("blend", 1)) == (Item("decode", 1, 0, (0,)),)


def test_fused_a_window_is_an_encode_a_task_per_chunk_and_its_cpu_task() -> None:
    """Where a chunk's denoise and its tiles' decodes are one task, a window of 9 one-tile chunks is 11 task runs
    (not 20), taken in the same order on one slot, and the blend still starts with the first tile."""
    graph = clip_graph(_plan(2), fused=True)
    for window in (0, 1):
        assert [i.stage for i in graph.items if i.window == window] == [
            "encode",
            *["denoise-decode"] * 9,
            "blend-segment",
        ]
    one = Lanes()
    _run(_plan(2), one, slots=1, fused=True)
    model = [(i.stage, i.window, i.index) for lane, i, _, _ in sorted(one.log, key=lambda r: r[2]) if lane == "model"]
    assert model == [
        ("encode", 0, 0),
        *[("denoise-decode", 0, n) for n in range(8)],
        ("encode", 1, 0),  # ready as the last chunk but one started: encoded before the window's last chunk
        ("denoise-decode", 0, 8),
        *[("denoise-decode", 1, n) for n in range(9)],
    ]
    two = Lanes(seconds=0.02)
    finished = _run(_plan(3), two, slots=2, fused=True)
    assert len(finished) == len(clip_graph(_plan(3), fused=True).items) and two.at_once == 2
    for window in range(3):
        blend = two.span("blend-segment", window)
        last_chunk_end = max(two.span("denoise-decode", window, n)[1] for n in range(9))
        assert two.span("denoise-decode", window, 0)[1] <= blend[0] < last_chunk_end <= blend[1]


def test_lanes_fuse_a_chunks_decodes_unless_a_chunks_tiles_could_spread_over_workers() -> None:
    from runtime.lanes import Lanes as TaskLanes

    def submit(task: object, parameters: dict) -> None:
        return None

    with pytest.warns(UserWarning, match="not lossless"):
        batched = make_plan((512, 768), 121, 24.0, UpscaleParams(scale=2, tiles_batch_size=3))
    assert len(batched.chunks) == 3
    threads, dask = TaskLanes(submit, submit, 2, "threads"), TaskLanes(submit, submit, 4, "dask", spread=True)
    assert threads.fuses(_plan(1)) and threads.fuses(batched)
    assert dask.fuses(_plan(1)) and not dask.fuses(batched)


def test_blend_and_segment_overlap_the_next_windows_model_work() -> None:
    lanes = Lanes(seconds=0.02)
    _run(_plan(3), lanes, slots=2)
    assert lanes.at_once == 2
    assert {lane for lane, i, _, _ in lanes.log if i.stage == "blend-segment"} == {"cpu"}
    for window in (0, 1):
        blend = lanes.span("blend-segment", window)
        # Window k's blend-segment runs while window k+1's tiles are still being denoised or decoded.
        next_model_end = max(e for lane, i, _, e in lanes.log if lane == "model" and i.window == window + 1)
        assert blend[0] < next_model_end
        # It starts with the first decoded tile and takes the others as they come: it begins before the window's
        # last decode ends, and ends after it.
        last_decode_end = max(lanes.span("decode", window, t)[1] for t in range(9))
        assert lanes.span("decode", window, 0)[1] <= blend[0] < last_decode_end <= blend[1]
        # The next window's starts once this one has ended (its segment cross-fades into this window's frames).
        assert lanes.span("blend-segment", window + 1)[0] >= blend[1]
    first_decode = lanes.span("decode", 0, 0)[0]
    assert first_decode < lanes.span("denoise", 0, 8)[1]


def test_a_failed_tile_stops_only_what_needs_it() -> None:
    failing = (Item("decode", 0, 4, (4,)),)
    lanes = Lanes(failing=failing)
    finished = _run(_plan(2), lanes, slots=2)
    ran = {(i.stage, i.window) for i in finished}
    # Window 0 cannot be blended (its blend-segment started with tile 0 and failed for want of tile 4), so window
    # 1's, whose segment reads window 0's frames, never starts.
    assert ("blend-segment", 0) in ran and Item("blend-segment", 0) in lanes.failed
    assert ("blend-segment", 1) not in ran
    # The model work of both windows is computed, so that a rerun has only that tile and what follows it left.
    assert sum(1 for i in finished if i.window == 1 and i.stage == "decode") == 9
    assert sum(1 for i in finished if i.window == 0 and i.stage == "decode") == 9


def test_a_window_whose_encode_fails_does_not_hold_back_the_next() -> None:
    lanes = Lanes(failing=(Item("encode", 0, 0, tuple(range(9))),))
    finished = _run(_plan(2), lanes, slots=2)
    assert [i.stage for i in finished if i.window == 0] == ["encode"]
    # The next window's model work goes on; its segment, which reads window 0's frames, waits for a rerun.
    assert {i.stage for i in finished if i.window == 1} == {"encode", "denoise", "decode"}


def test_the_model_lane_needs_a_slot() -> None:
    with pytest.raises(ValueError, match="slot"):
        Scheduler(clip_graph(_plan(1)), Lanes().model, Lanes().cpu, slots=0)


def _run_clips(plans: list[ClipPlan], lanes: Lanes, slots: int) -> dict[int, list[Item]]:
    """The clips' schedulers at once, each in a thread of its own, sharing one model queue (as an archive's do)."""
    shared = ModelQueue(slots)
    finished: dict[int, list[Item]] = {}

    def clip(rank: int) -> None:
        scheduler = Scheduler(clip_graph(plans[rank]), lanes.model, lanes.cpu, shared, rank=rank)
        finished[rank] = [item for item, _ in scheduler.run()]

    threads = [threading.Thread(target=clip, args=(rank,)) for rank in range(len(plans))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return finished


def test_clips_sharing_a_queue_never_exceed_its_slots_and_the_earlier_clip_goes_first() -> None:
    # The first encode ends only once the second has started (bounded): on a loaded machine the second clip's thread
    # may offer its encode more than an item's time late, when the first clip's denoise would rightly take the slot.
    started, both = [], threading.Event()

    def encodes_together(item: Item) -> None:
        if item.stage == "encode":
            started.append(item)
            if len(started) == 2:
                both.set()
            both.wait(timeout=10)

    lanes = Lanes(seconds=0.01, on_start=encodes_together)
    finished = _run_clips([_plan(1), _plan(1)], lanes, slots=2)
    everything = len(clip_graph(_plan(1)).items)
    assert sorted(finished) == [0, 1] and all(len(items) == everything for items in finished.values())
    assert lanes.at_once == 2  # two clips, each of which alone would take two slots, still share two
    # Both clips' encodes ran first, side by side: the second clip's frames are encoded while the first clip has
    # nothing else ready for the model (which clip goes first is test_the_queue_grants_the_lowest_rank_first's).
    model = sorted((start, end, item) for lane, item, start, end in lanes.log if lane == "model")
    encodes = [start for start, _, item in model if item.stage == "encode"]
    assert len(encodes) == 2 and max(encodes) < model[2][0]


def test_a_scheduler_that_stops_gives_its_slots_to_the_others() -> None:
    shared = ModelQueue(1)
    lanes = Lanes(seconds=0.01)
    stopped = Scheduler(clip_graph(_plan(1)), lanes.model, lanes.cpu, shared, rank=0)
    run = stopped.run()
    next(run)  # its encode ran; its first denoise is granted or offered
    run.close()  # the flow stops reading it (an interrupt, say)
    other = Scheduler(clip_graph(_plan(1)), lanes.model, lanes.cpu, shared, rank=1)
    done = threading.Event()
    items: list[Item] = []

    def drain() -> None:
        items.extend(item for item, _ in other.run())
        done.set()

    threading.Thread(target=drain, daemon=True).start()
    assert done.wait(timeout=20), "the stopped scheduler kept the only slot"
    assert len(items) == len(clip_graph(_plan(1)).items)


def test_the_queue_grants_the_lowest_rank_first() -> None:
    shared = ModelQueue(1)
    granted: list[str] = []
    shared.offer((0,), lambda: granted.append("holder"))
    shared.offer((5, 0), lambda: granted.append("late clip"))
    shared.offer((1, 9), lambda: granted.append("early clip"))
    assert granted == ["holder"]
    shared.release()
    shared.release()
    assert granted == ["holder", "early clip", "late clip"]


def test_a_cpu_queue_bounds_the_cpu_lane_and_everything_still_runs() -> None:
    """Where both lanes share the workers' threads, the CPU lane takes slots too: never more CPU items at once than
    it has, and the blends, which wait for their tiles on their thread, never keep a decode from running."""
    lanes = Lanes(seconds=0.01)
    cpu_at_once = 0
    running = 0
    lock = threading.Lock()

    def cpu(item: Item) -> Future:
        nonlocal running, cpu_at_once
        with lock:
            running += 1
            cpu_at_once = max(cpu_at_once, running)
        future = lanes.cpu(item)

        def ended(_: Future) -> None:
            nonlocal running
            with lock:
                running -= 1

        future.add_done_callback(ended)
        return future

    plan = _plan(3)
    scheduler = Scheduler(clip_graph(plan), lanes.model, cpu, 2, cpu_slots=ModelQueue(1))
    finished = [item for item, _ in scheduler.run()]
    assert len(finished) == len(clip_graph(plan).items) and cpu_at_once == 1


def test_without_a_streaming_blend_a_window_is_blended_once_every_tile_is_decoded() -> None:
    """What a cluster whose threads both lanes share without model slots gets (`runtime.lanes`)."""
    graph = clip_graph(_plan(1), stream_blend=False)
    blend = Item("blend-segment", 0)
    assert graph.needs_to_start(blend) == graph.needs[blend] and len(graph.needs[blend]) == 9
    assert clip_graph(_plan(1)).needs_to_start(blend) == (Item("decode", 0, 0, (0,)),)


@pytest.mark.parametrize(
    ("workers", "slots", "cpu_slots", "streams"),
    [
        # Workers k6vsr starts: two model slots and three CPU threads each.
        ([{"nthreads": 5, "resources": {"k6vsr-model": 2}}] * 2, 4, 6, True),
        # A fleet's workers started by hand with no thread beside their slots: the lanes share every thread.
        ([{"nthreads": 2, "resources": {"k6vsr-model": 2}}], 2, None, False),
        # Workers without model slots: both lanes on every thread, and a blend that never waits on one.
        ([{"nthreads": 1}, {"nthreads": 1}], 2, None, False),
    ],
)
def test_lanes_on_dask_workers_bound_the_cpu_lane_where_threads_are_shared(
    workers: list[dict], slots: int, cpu_slots: int | None, streams: bool
) -> None:
    from prefect_dask import DaskTaskRunner

    from runtime.lanes import lanes_for

    class Client:
        def scheduler_info(self, n_workers: int) -> dict:
            return {"address": "tcp://127.0.0.1:1", "workers": {f"w{n}": worker for n, worker in enumerate(workers)}}

    runner = DaskTaskRunner.__new__(DaskTaskRunner)
    runner.__dict__["_client"] = Client()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DaskTaskRunner, "client", property(lambda self: self.__dict__["_client"]))
        with lanes_for(runner) as lanes:
            assert (lanes.slots, lanes.cpu_slots or None, lanes.stream_blend) == (slots, cpu_slots, streams)
