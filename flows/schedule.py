"""The order a clip's tasks run in: each as soon as its inputs exist, the model's work most urgent first.

A window is encode -> denoise per chunk -> decode per tile -> blend -> segment (a segment also reads the window
before). Submitted all at once, tasks ran in submission order: every denoise chunk of a window before its first
decode, and blends and segments queued behind model work on the same threads. So the flow submits each task when
its inputs are in, to one of two lanes:

- the model lane (encode, denoise, decode) holds at most `slots` tasks at once and takes the most urgent ready one:
  an earlier window before a later one, within a window a decode before a denoise before an encode, so a tile is
  decoded as soon as its chunk is denoised. The next window's encode becomes ready once the last denoise of the
  window before it is under way: its frames are read and encoded while that window's tiles decode, and no more than
  one window is encoded ahead;
- the CPU lane (blend, segment) takes a task the moment its inputs are in, beside the model lane, so a window's
  blend and segment overlap the next window's model work.

This module knows nothing of Prefect: a lane is a function that starts an item and returns a future with
`add_done_callback` (a Prefect future, or a `concurrent.futures.Future` in tests).
"""

from __future__ import annotations

import heapq
import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from k6vsr_core.plan import ClipPlan

MODEL_STAGES = ("decode", "denoise", "encode")  # within a window, the most urgent first
CPU_STAGES = ("blend", "segment")


@dataclass(frozen=True)
class Item:
    """One task of a clip run: a stage of a window, and the chunk (denoise) or tile (decode) it computes."""

    stage: str
    window: int
    index: int = 0
    tiles: tuple[int, ...] = ()  # the tiles its failure stands for (none: the window's own stage)

    @property
    def on_model(self) -> bool:
        return self.stage in MODEL_STAGES

    @property
    def urgency(self) -> tuple[int, int, int]:
        """Smaller runs first among ready model work."""
        return (self.window, MODEL_STAGES.index(self.stage), self.index)


@dataclass(frozen=True)
class Graph:
    """A clip's items in pipeline order, what each needs finished, and what needs only to have started."""

    items: tuple[Item, ...]
    needs: dict[Item, tuple[Item, ...]]
    after_start: dict[Item, tuple[Item, ...]]  # only the items that have such a condition

    def waits_for_start(self, item: Item) -> tuple[Item, ...]:
        return self.after_start.get(item, ())


def clip_graph(plan: ClipPlan) -> Graph:
    items: list[Item] = []
    needs: dict[Item, tuple[Item, ...]] = {}
    after_start: dict[Item, tuple[Item, ...]] = {}
    blends: list[Item] = []
    last_denoises: tuple[Item, ...] = ()
    for window in range(plan.num_windows):
        encode = Item("encode", window, tiles=tuple(range(plan.num_tiles)))
        needs[encode] = ()
        after_start[encode] = last_denoises  # one window encoded ahead, no more
        chunks = {c.index: Item("denoise", window, c.index, c.tiles) for c in plan.chunks}
        for chunk in chunks.values():
            needs[chunk] = (encode,)
        decodes = [Item("decode", window, t, (t,)) for t in range(plan.num_tiles)]
        for decode in decodes:
            needs[decode] = (chunks[plan.chunk_of(decode.index).index],)
        blends.append(Item("blend", window))
        needs[blends[-1]] = tuple(decodes)
        segment = Item("segment", window)
        needs[segment] = tuple(blends[-2:])
        items += [encode, *chunks.values(), *decodes, blends[-1], segment]
        last_denoises = tuple(chunks.values())
    return Graph(tuple(items), needs, after_start)


class Future(Protocol):
    def add_done_callback(self, fn: Callable[[Any], None]) -> None: ...


Submit = Callable[[Item], Future]


class Scheduler:
    """Runs a graph's items through a model lane of `slots` and an unbounded CPU lane, in the order above.

    `run` yields each finished item with its future, in the order they finish; the caller reads the future and calls
    `failed(item)` before asking for the next one if it did not succeed. Items that need a failed one never start;
    an item waiting only for such an item to start starts anyway, so a window that fails does not stop the next.
    """

    def __init__(self, graph: Graph, model: Submit, cpu: Submit, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"the model lane needs a slot at least, got {slots}")
        self._model, self._cpu, self._slots = model, cpu, slots
        self._order = {item: n for n, item in enumerate(graph.items)}
        self._blocked = {item: len(graph.needs[item]) + len(graph.waits_for_start(item)) for item in graph.items}
        self._needed_by: dict[Item, list[Item]] = {item: [] for item in graph.items}
        self._started_for: dict[Item, list[Item]] = {item: [] for item in graph.items}
        for item in graph.items:
            for need in graph.needs[item]:
                self._needed_by[need].append(item)
            for first in graph.waits_for_start(item):
                self._started_for[first].append(item)
        self._ready_model: list[tuple[tuple[int, int, int], int, Item]] = []  # a heap, most urgent first
        self._ready_cpu: list[Item] = []
        self._failed: set[Item] = set()
        self._finished: queue.Queue[tuple[Item, Future]] = queue.Queue()
        for item in graph.items:
            if not self._blocked[item]:
                self._make_ready(item)

    def failed(self, item: Item) -> None:
        self._failed.add(item)

    def run(self) -> Iterator[tuple[Item, Future]]:
        running_model = running_cpu = 0
        while True:
            while self._ready_cpu:
                self._start(self._ready_cpu.pop(0), self._cpu)
                running_cpu += 1
            while self._ready_model and running_model < self._slots:
                self._start(heapq.heappop(self._ready_model)[2], self._model)
                running_model += 1
            if not running_model + running_cpu:
                return  # what is left needs a failed item
            item, future = self._finished.get()
            if item.on_model:
                running_model -= 1
            else:
                running_cpu -= 1
            yield item, future
            if item in self._failed:
                self._abandon(item)
            else:
                for dependent in self._needed_by[item]:
                    self._unblock(dependent)

    def _make_ready(self, item: Item) -> None:
        if item.on_model:
            heapq.heappush(self._ready_model, (item.urgency, self._order[item], item))
        else:
            self._ready_cpu.append(item)

    def _unblock(self, item: Item) -> None:
        self._blocked[item] -= 1
        if not self._blocked[item]:
            self._make_ready(item)

    def _start(self, item: Item, lane: Submit) -> None:
        future = lane(item)
        future.add_done_callback(lambda done, item=item: self._finished.put((item, done)))
        self._started(item)

    def _started(self, item: Item) -> None:
        for waiting in self._started_for[item]:
            self._unblock(waiting)

    def _abandon(self, item: Item) -> None:
        """`item` failed or will never start: what needs it never starts, what waits for it to start may."""
        for dependent in self._needed_by[item]:
            if dependent not in self._failed:
                self._failed.add(dependent)
                self._started(dependent)
                self._abandon(dependent)
