"""The order a clip's tasks run in: each as soon as its inputs exist, the model's work most urgent first.

A window is encode -> denoise per chunk -> decode per tile -> blend -> segment -> quality (a segment also reads the
window before); its blend, segment and quality are one task (`blend-segment`: each task run costs the Prefect API
the same few requests, whatever it does). Submitted all at once, tasks ran in submission order: every denoise chunk
of a window before its first decode, and blends and segments queued behind model work on the same threads. So the
flow submits each task when its inputs are in, to one of two lanes:

- the model lane (encode, denoise, decode) holds at most `slots` tasks at once and takes the most urgent ready one:
  an earlier window before a later one, within a window a decode before a denoise before an encode, so a tile is
  decoded as soon as its chunk is denoised; an encode, short and what makes its window's chunks ready, before
  anything else. The next window's encode becomes ready once the last denoise but one of the window before it is
  under way: its frames are read and encoded while that window's last chunk computes, and no more than one window
  is encoded ahead;
- the CPU lane (a window's `blend-segment`: its blend, its segment and its part of the quality report,
  `tasks.quality`) takes a task the moment its inputs are in, beside the model lane, so a window's blend, segment
  and measures overlap the next window's model work. A window's task starts with its first decoded tile, once the
  window before it is through its own (its segment cross-fades into that window's frames), and adds the others as
  they are decoded (`tasks.stage_tasks.blend` waits for them), so what is left of its blend after the window's last
  decode is one tile and the division. A clip's windows go through the CPU lane one after another: a window's
  CPU work is seconds, its model work many more, so the order costs no overlap with the model lane.

The model lane's slots are a `ModelQueue`, which the clips of an archive share: it grants a free slot to the most
urgent ready item of every clip that computes on the same workers, an earlier clip's before a later one's, so the
next clip's frames are read and encoded while the clip before it finishes, and its tiles take the GPU the moment
the earlier clip has nothing ready for it.

This module knows nothing of Prefect: a lane is a function that starts an item and returns a future with
`add_done_callback` (a Prefect future, or a `concurrent.futures.Future` in tests).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from k6vsr_core.contract.plan import ClipPlan
from k6vsr_core.contract.stage_names import TaskKind

# The model lane's items, within a window the most urgent first: a decode, a chunk (denoised, or denoised and
# decoded as one task where that spreads no less work), an encode.
MODEL_ITEMS = (TaskKind.DECODE, TaskKind.DENOISE_DECODE, TaskKind.DENOISE, TaskKind.ENCODE)
# A window's CPU items: a run's (its blend, segment and part of the quality report, one task), or a preview's blend
# alone (flows.preview, `clip_graph(segments=False)`).
CPU_ITEMS = (TaskKind.BLEND_SEGMENT, TaskKind.BLEND)


@dataclass(frozen=True)
class Item:
    """One task of a clip run: a stage of a window (or a few, as one task), and the chunk (denoise) or tile (decode)
    it computes."""

    stage: TaskKind
    window: int
    index: int = 0
    tiles: tuple[int, ...] = ()  # the tiles its failure stands for (none: the window's own stages)

    @property
    def on_model(self) -> bool:
        return self.stage in MODEL_ITEMS

    @property
    def urgency(self) -> tuple[int, int, int]:
        """Smaller runs first among ready work of its lane: an earlier window first, then by stage (a decode before a
        denoise before an encode), then by chunk or tile."""
        stages = MODEL_ITEMS if self.on_model else CPU_ITEMS
        return (self.window, stages.index(self.stage), self.index)


@dataclass(frozen=True)
class Graph:
    """A clip's items in pipeline order, what each needs finished, and what needs only to have started.

    An item in `starts_with` starts once those of its needs are finished and waits for the others itself (a blend
    adds tiles as they are decoded); should one of those fail, it fails too, and so does what needs it.
    """

    items: tuple[Item, ...]
    needs: dict[Item, tuple[Item, ...]]
    after_start: dict[Item, tuple[Item, ...]]  # only the items that have such a condition
    starts_with: dict[Item, tuple[Item, ...]]  # likewise

    def waits_for_start(self, item: Item) -> tuple[Item, ...]:
        return self.after_start.get(item, ())

    def needs_to_start(self, item: Item) -> tuple[Item, ...]:
        return self.starts_with.get(item, self.needs[item])


def clip_graph(plan: ClipPlan, stream_blend: bool = True, segments: bool = True, fused: bool = False) -> Graph:
    """The items of a clip. With `stream_blend`, a window's CPU item starts with its first decoded tile (it waits for
    the others itself: its lane must have a thread for it that no decode needs); without, once every tile is decoded.
    With `segments`, that item is the window's `blend-segment`, which needs the window before's too; without (a
    preview), its blend alone. With `fused`, a chunk's item denoises it and then decodes its tiles (`denoise-decode`),
    one task in place of a denoise and a decode per tile: the order the model lane would take them in anyway (a
    tile's decode is the most urgent item once its chunk is denoised), so what is left out is only the tasks."""
    items: list[Item] = []
    needs: dict[Item, tuple[Item, ...]] = {}
    after_start: dict[Item, tuple[Item, ...]] = {}
    starts_with: dict[Item, tuple[Item, ...]] = {}
    blends: list[Item] = []
    last_denoises: tuple[Item, ...] = ()
    for window in range(plan.num_windows):
        encode = Item(TaskKind.ENCODE, window, tiles=tuple(range(plan.num_tiles)))
        needs[encode] = ()
        # One window encoded ahead, no more: it becomes ready as the window before's last chunk but one starts (its
        # only chunk, if one), so that it is encoded while that window's last chunk computes, not after.
        after_start[encode] = last_denoises[-2:-1] or last_denoises
        chunk_stage = TaskKind.DENOISE_DECODE if fused else TaskKind.DENOISE
        chunks = {c.index: Item(chunk_stage, window, c.index, c.tiles) for c in plan.chunks}
        for chunk in chunks.values():
            needs[chunk] = (encode,)
        decodes = [] if fused else [Item(TaskKind.DECODE, window, t, (t,)) for t in range(plan.num_tiles)]
        for decode in decodes:
            needs[decode] = (chunks[plan.chunk_of(decode.index).index],)
        tiled = decodes or list(chunks.values())  # the items that give the window's tiles, the first one first
        before = tuple(blends[-1:]) if segments else ()  # its segment cross-fades into the window before's frames
        blends.append(Item(TaskKind.BLEND_SEGMENT if segments else TaskKind.BLEND, window))
        needs[blends[-1]] = (*tiled, *before)
        if stream_blend:
            starts_with[blends[-1]] = (tiled[0], *before)  # it adds the others as they are decoded, in tile order
        items += [encode, *chunks.values(), *decodes, blends[-1]]
        last_denoises = tuple(chunks.values())
    return Graph(tuple(items), needs, after_start, starts_with)


class Future(Protocol):
    def add_done_callback(self, fn: Callable[[Any], None]) -> None: ...

    def result(self) -> Any: ...


Submit = Callable[[Item], Future]
Grant = Callable[[], None]


class ModelQueue:
    """A lane's slots, shared by every scheduler whose tasks go to the same workers (the model lane's; and the CPU
    lane's where it shares their threads).

    A scheduler offers each ready model item with its rank (the clip's place in an archive) and urgency; whenever
    a slot is free the most urgent offer of all, the lowest rank first, is granted: its `grant` is called, from the
    thread that freed the slot, and the scheduler that offered it starts it in its own thread (a task is submitted
    from its own flow run). A granted item holds its slot until `release`.
    """

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"the model lane needs a slot at least, got {slots}")
        self.slots = slots
        self._lock = threading.Lock()
        self._running = 0
        self._offers: list[tuple[tuple[int, ...], int, Grant]] = []  # a heap, most urgent first
        self._arrival = itertools.count()

    def offer(self, rank: tuple[int, ...], grant: Grant) -> None:
        with self._lock:
            heapq.heappush(self._offers, (rank, next(self._arrival), grant))
            granted = self._grants()
        for call in granted:
            call()

    def release(self) -> None:
        with self._lock:
            self._running -= 1
            granted = self._grants()
        for call in granted:
            call()

    def withdraw(self, grants: set[Grant]) -> None:
        """Drop the offers of a scheduler that stops."""
        with self._lock:
            self._offers = [offer for offer in self._offers if offer[2] not in grants]
            heapq.heapify(self._offers)

    def _grants(self) -> list[Grant]:
        granted = []
        while self._offers and self._running < self.slots:
            granted.append(heapq.heappop(self._offers)[2])
            self._running += 1
        return granted


class Scheduler:
    """Runs a graph's items through the model lane's `ModelQueue` and the CPU lane, in the order above.

    `run` yields each finished item with its future, in the order they finish; the caller reads the future and calls
    `failed(item)` before asking for the next one if it did not succeed. Items that need a failed one never start;
    an item waiting only for such an item to start starts anyway, so a window that fails does not stop the next.
    `rank` places this clip's work among the other clips sharing the queues (smaller first). The CPU lane takes every
    ready item at once unless it is given a queue too (`cpu_slots`): on workers whose threads both lanes share, a
    blend waiting for its tiles must never hold the thread a decode needs.
    """

    def __init__(
        self,
        graph: Graph,
        model: Submit,
        cpu: Submit,
        slots: ModelQueue | int,
        rank: int = 0,
        cpu_slots: ModelQueue | None = None,
    ) -> None:
        self._queues = {True: slots if isinstance(slots, ModelQueue) else ModelQueue(slots), False: cpu_slots}
        self._model, self._cpu, self._rank = model, cpu, rank
        self._order = {item: n for n, item in enumerate(graph.items)}
        self._blocked = {
            item: len(graph.needs_to_start(item)) + len(graph.waits_for_start(item)) for item in graph.items
        }
        self._needed_by: dict[Item, list[Item]] = {item: [] for item in graph.items}  # fail with it
        self._unblocks: dict[Item, list[Item]] = {item: [] for item in graph.items}  # may start once it is done
        self._started_for: dict[Item, list[Item]] = {item: [] for item in graph.items}
        for item in graph.items:
            for need in graph.needs[item]:
                self._needed_by[need].append(item)
            for need in graph.needs_to_start(item):
                self._unblocks[need].append(item)
            for first in graph.waits_for_start(item):
                self._started_for[first].append(item)
        self._ready_cpu: list[Item] = []  # without a CPU queue: started at once
        self._failed: set[Item] = set()
        # ("done", item, future) when an item ends; ("granted", item, None) when its queue gives it a slot.
        self._events: queue.Queue[tuple[str, Item, Future | None]] = queue.Queue()
        self._offered: dict[Item, Grant] = {}  # offered to a queue, not yet started
        self._lock = threading.Lock()
        self._closed = False
        for item in graph.items:
            if not self._blocked[item]:
                self._make_ready(item)

    def failed(self, item: Item) -> None:
        self._failed.add(item)

    def run(self) -> Iterator[tuple[Item, Future]]:
        running = 0
        try:
            while True:
                while self._ready_cpu:
                    self._start(self._ready_cpu.pop(0))
                    running += 1
                if not running and not self._offered:
                    return  # what is left needs a failed item
                kind, item, future = self._events.get()
                if kind == "granted":
                    del self._offered[item]
                    self._start(item)
                    running += 1
                    continue
                running -= 1
                if future is None:
                    raise RuntimeError(f"{item} ended without its future")
                try:
                    yield item, future
                    if item in self._failed:
                        self._abandon(item)
                    else:
                        for dependent in self._unblocks[item]:
                            self._unblock(dependent)
                finally:
                    # After its dependents are offered: a tile is decoded as soon as its chunk is denoised.
                    self._release(item)
        finally:
            self._close()

    def _queue(self, item: Item) -> ModelQueue | None:
        return self._queues[item.on_model]

    def _release(self, item: Item) -> None:
        lane = self._queue(item)
        if lane is not None:
            lane.release()

    def _close(self) -> None:
        """Give back the slots this scheduler holds and will not use, and withdraw what it still offers; a task
        still running gives its slot back as it ends."""
        with self._lock:
            self._closed = True
            for lane in self._queues.values():
                if lane is not None:
                    lane.withdraw(set(self._offered.values()))
        while not self._events.empty():
            _, item, _ = self._events.get_nowait()
            self._release(item)  # a slot granted and not used, or held by a task that ended

    def _make_ready(self, item: Item) -> None:
        lane = self._queue(item)
        if lane is None:
            self._ready_cpu.append(item)
            return

        def grant(item: Item = item) -> None:
            with self._lock:
                closed = self._closed
                if not closed:
                    self._events.put(("granted", item, None))
            if closed:
                self._release(item)

        self._offered[item] = grant
        # An encode goes first, whichever clip it is of: it is short, and what it makes ready (its window's chunks)
        # keeps the device busy once the work in flight is done; the graph lets only one window be encoded ahead.
        lane.offer((item.stage != TaskKind.ENCODE, self._rank, *item.urgency, self._order[item]), grant)

    def _unblock(self, item: Item) -> None:
        self._blocked[item] -= 1
        if not self._blocked[item] and item not in self._failed:
            self._make_ready(item)

    def _start(self, item: Item) -> None:
        future = (self._model if item.on_model else self._cpu)(item)
        future.add_done_callback(functools.partial(self._ended, item))
        self._started(item)

    def _ended(self, item: Item, future: Future) -> None:
        with self._lock:
            closed = self._closed
            if not closed:
                self._events.put(("done", item, future))
        if closed:
            self._release(item)  # nobody reads this scheduler's events any more; another clip may want the slot

    def _started(self, item: Item) -> None:
        for waiting in self._started_for[item]:
            self._unblock(waiting)

    def _abandon(self, item: Item) -> None:
        """`item` failed or will never start: what needs it never starts (or, started, fails of itself), what waits
        for it to start may."""
        for dependent in self._needed_by[item]:
            if dependent not in self._failed:
                self._failed.add(dependent)
                self._started(dependent)
                self._abandon(dependent)
