"""The time a clip run has left, from what its items took and what its plan has left to do.

The plan knows every item; the records say which are done and, for those computed, when each ran. The model's items
(encode, denoise, decode) hold the run back: they share the model lane, a few at once, in the order its scheduler
grants them (`runtime.schedule`: an encode first once ready, then the earliest window's decodes, then its denoises).
What is left is that lane replayed forward: its slots taken by the items not done, a slot freeing when the item on
it ends; an item in flight started when its slot last freed. Then the last window's tail, which nothing overlaps:
its blend from its last decode (the blend's own record spans its wait for the decodes, and says nothing of its
work), its segment and the mux. CPU items of earlier windows run beside the model lane and add nothing.

The items in flight on the lane share one device (a CPU's cores; on a GPU, model calls take turns), so an item timed
while k ran took k times what it would alone. A model item's pace is counted in device-seconds (each second of its
span divided by the items in flight then, those still running without a record included), and the lane is
replayed as processor sharing: the items in flight split the device, so a lone last item goes as fast as the device
allows rather than at the pace its pair was timed at. Each stage's pace is over its latest window (the machine's
pace now: another process's load changes it within a run). An attempt killed left no record of the items it had in
flight; they are found as its lane replayed to its last record, and counted as sharing the device with the items
recorded beside them. An item in flight longer than its stage's pace counts among the stage's latest items at what
it has taken so far: the machine is slower now, which its record would say only once it ends. An archive's clips in
flight together share one model queue, and a clip's records show none of the others' items: there the device is
counted full throughout (`seconds_left`'s `shared`); the archive's own time left (`archive_seconds_left`) adds the
clips not started, their planned items at the seconds an item took in the clips seen so far.

A pace is this run's: an item found done when the run started says nothing of this run's pace (it took no time
here), and its record's seconds were of another process. Until this run has timed a stage, the timings earlier
attempts of the same run left in its timeline stand in for it, so a resumed run shows a figure from its first
item on. The estimate is None (`? left`) while a model stage with items left has no timing at all: a first
window's decode cannot be guessed from its encode.

The estimate counts down between item ends, so the terminal shows a time that moves every second and corrects
itself as items finish.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from k6vsr_core.contract.plan import ClipPlan
from k6vsr_core.contract.stage_names import MODEL_STAGES, Stage
from storage.progress import stage_items
from storage.records import CompletionRecord

__all__ = ["ClipTime", "Span", "archive_seconds_left", "items_left", "seconds_left", "window_items"]


@dataclass(frozen=True)
class Span:
    """One computed item: its stage, when it ran (seconds since the epoch) and its record's item name."""

    stage: str
    start: float
    end: float
    item: str = ""

    @classmethod
    def of(cls, record: CompletionRecord) -> Span:
        return cls(record.stage, record.written_at - record.seconds, record.written_at, record.item)

    @classmethod
    def of_line(cls, line: Mapping[str, object]) -> Span | None:
        """A timeline line's span (`storage.records.RecordBook.timeline`); None for a line that is not one."""
        try:
            return cls(str(line["stage"]), float(line["start"]), float(line["end"]), str(line["item"]))  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def window(self) -> int | None:
        head = self.item.split("-", 1)[0]
        return int(head) if head.isdigit() else None


def window_items(plan: ClipPlan) -> dict[str, int]:
    """Each recorded stage's items in one window: the latest window's pace is the one `seconds_left` counts with."""
    return {stage: max(1, len(items) // plan.num_windows) for stage, items in stage_items(plan).items()}


def items_left(plan: ClipPlan, done: Mapping[Stage, Iterable[str]]) -> dict[str, int]:
    """Each recorded stage's items of `plan` not in `done` (the items recorded done, by stage)."""
    return {stage: len(set(items) - set(done.get(stage, ()))) for stage, items in stage_items(plan).items()}


_Paces = Mapping[str, float]  # a stage's seconds per computed frame


def _frames(plan: ClipPlan, span: Span) -> int:
    """What an item's time grows with: its window's computed frames (scene windows differ in length)."""
    window = span.window
    return plan.windows[window].padded if window is not None and window < plan.num_windows else 1


@dataclass(frozen=True)
class _Sharing:
    """The model items in flight at each instant, which share the device (a CPU's cores; a GPU's model calls take
    turns): over a stretch with k of them, each got a k-th of it. An item's device-seconds are its wall seconds
    each divided by the items in flight then: what it would take alone, and, k at once, k times as long. No fewer
    than `floor` share it: items of other clips the records do not show fill the device (`seconds_left`'s
    `shared`)."""

    times: list[float]  # where the count changes
    counts: list[int]  # the items in flight from each time to the next
    before: list[float]  # device-seconds of one item from the first time to each
    floor: int = 1

    @classmethod
    def of(cls, tasks: Iterable[tuple[float, float]], floor: int = 1) -> _Sharing:
        changes: dict[float, int] = {}
        for start, end in tasks:
            changes[start] = changes.get(start, 0) + 1
            changes[end] = changes.get(end, 0) - 1
        times, count = sorted(changes), 0
        counts: list[int] = []
        before: list[float] = []
        for index, time in enumerate(times):
            before.append(before[-1] + (time - times[index - 1]) / max(floor, counts[-1]) if index else 0.0)
            count += changes[time]
            counts.append(count)
        return cls(times, counts, before, floor)

    def _at(self, time: float) -> float:
        index = bisect.bisect_right(self.times, time) - 1
        if index < 0:
            return (time - (self.times[0] if self.times else 0.0)) / self.floor
        return self.before[index] + (time - self.times[index]) / max(self.floor, self.counts[index])

    def seconds(self, start: float, end: float) -> float:
        """An item's device-seconds over [start, end]."""
        return self._at(end) - self._at(start)

    def count(self, time: float) -> int:
        """The items in flight just after `time`."""
        index = bisect.bisect_right(self.times, time) - 1
        return self.counts[index] if index >= 0 else 0

    def next_change(self, time: float) -> float | None:
        index = bisect.bisect_right(self.times, time)
        return self.times[index] if index < len(self.times) else None


def _paces(
    plan: ClipPlan,
    spans: list[Span],
    recent: Mapping[str, int],
    device: _Sharing,
    running: Iterable[tuple[str, float]] = (),
) -> dict[str, float]:
    """Each stage's seconds per computed frame over its `recent[stage]` latest items: a model item's in device-seconds
    (`device`: its share of the device over its span), the blend's from its window's last decode to its end (what it
    adds once the decodes are done). `running`: the model items in flight, each with its stage and the device-seconds
    per frame it has taken so far; one that has taken longer than its stage's pace counts among the latest items at
    what it has taken (a floor: it is not done), so a slowing machine shows before its slow items end."""
    per_frame: dict[str, list[float]] = {}
    decoded: dict[int, list[float]] = {}
    for span in sorted(spans, key=lambda span: span.end):
        if span.stage == Stage.DECODE and span.window is not None:
            decoded.setdefault(span.window, []).append(span.end)
    for span in sorted(spans, key=lambda span: span.end):
        seconds = device.seconds(span.start, span.end) if span.stage in MODEL_STAGES else span.end - span.start
        if span.stage == Stage.BLEND:
            ends = decoded.get(span.window, []) if span.window is not None else []
            if len(ends) < plan.num_tiles:  # its decodes ran before these spans: its wait cannot be told apart
                continue
            # From its last decode, or from its own start where that came later (a resumed run's first blend).
            seconds = max(0.0, span.end - max(span.start, *ends))
        per_frame.setdefault(span.stage, []).append(seconds / _frames(plan, span))
    kept = {stage: values[-recent.get(stage, len(values)) :] for stage, values in per_frame.items()}
    paces = {stage: sum(values) / len(values) for stage, values in kept.items()}
    for stage, taken in running:
        if stage in paces and taken > paces[stage]:
            kept[stage].append(taken)
    return {stage: sum(values) / len(values) for stage, values in kept.items()}


def _tasks(plan: ClipPlan, spans: Iterable[Span]) -> list[tuple[float, float]]:
    """The model lane's tasks: a chunk's denoise records each of its tiles over the one task's interval."""
    tasks: dict[tuple[str, int | None, str], tuple[float, float]] = {}
    for span in spans:
        if span.stage not in MODEL_STAGES:
            continue
        item = span.item
        if span.stage == Stage.DENOISE and span.window is not None and "-" in item:
            item = str(plan.chunk_of(int(item.split("-", 1)[1])).index)
        tasks[(span.stage, span.window, item)] = (span.start, span.end)
    return sorted(tasks.values())


def _width(tasks: list[tuple[float, float]]) -> int:
    """The lane's width: the most of its tasks seen running at once, at the middle of one of them. (Busy seconds over
    the wall clock read low whenever a task is in flight, which the records cannot show until it ends.)"""
    starts, ends = sorted(start for start, _ in tasks), sorted(end for _, end in tasks)
    middles = ((start + end) / 2 for start, end in tasks)
    return max((bisect.bisect_right(starts, m) - bisect.bisect_left(ends, m) for m in middles), default=1)


@dataclass
class _Item:
    stage: str
    window: int
    seconds: float
    needs: list[int]  # items that must end first
    after_start: list[int]  # items that must have started
    end: float | None = None  # known: recorded done


def _lane_items(
    plan: ClipPlan,
    done: Mapping[Stage, Iterable[str]],
    ends: Mapping[tuple[str, str], float],
    paces: Mapping[str, float],
) -> list[_Item]:
    """The run's model items in the scheduler's graph (`runtime.schedule.clip_graph`), those done with their end."""
    done_sets = {stage: set(done.get(stage, ())) for stage in (*MODEL_STAGES, Stage.BLEND, Stage.SEGMENT)}
    items: list[_Item] = []
    last_chunks: list[int] = []
    for window in plan.windows:
        w, frames = window.index, window.padded
        encode = len(items)
        items.append(
            _Item(Stage.ENCODE, w, paces.get(Stage.ENCODE, 0.0) * frames, [], last_chunks[-2:-1] or last_chunks)
        )
        if str(w) in done_sets[Stage.ENCODE]:
            items[encode].end = ends.get((Stage.ENCODE, str(w)), float("-inf"))
        chunks: dict[int, int] = {}
        for chunk in plan.chunks:
            chunks[chunk.index] = len(items)
            item = _Item(Stage.DENOISE, w, paces.get(Stage.DENOISE, 0.0) * frames, [encode], [])
            names = [f"{w}-{tile}" for tile in chunk.tiles]
            if all(name in done_sets[Stage.DENOISE] for name in names):
                item.end = max(ends.get((Stage.DENOISE, name), float("-inf")) for name in names)
            items.append(item)
        for tile in range(plan.num_tiles):
            item = _Item(
                Stage.DECODE, w, paces.get(Stage.DECODE, 0.0) * frames, [chunks[plan.chunk_of(tile).index]], []
            )
            if f"{w}-{tile}" in done_sets[Stage.DECODE]:
                item.end = ends.get((Stage.DECODE, f"{w}-{tile}"), float("-inf"))
            items.append(item)
        last_chunks = list(chunks.values())
    # A window blended or written needs none of its model items again, whatever records they kept.
    for item in items:
        if item.end is None and any(str(item.window) in done_sets[stage] for stage in (Stage.BLEND, Stage.SEGMENT)):
            item.end = float("-inf")
    return items


_EPSILON = 1e-6


def _urgency(item: _Item, position: int) -> tuple[int, int, int]:
    """The order the lane is replayed in among ready items: the earliest window first, its decodes before its
    denoises. The scheduler takes a ready encode before either; guessing instead that a decode took the slot
    it freed errs by an encode's few seconds until its record comes, where the other guess, wrong, waits for a
    decode that ran all along."""
    return (item.window, item.stage != Stage.DECODE, position)


class _Lane:
    """The model lane replayed from `now`'s view: the items not done taken in the scheduler's order by its slots,
    each slot free from its time in `free`, the items in flight splitting the device (an item's `seconds` are
    device-seconds: k in flight each go at a k-th of their pace) with the items `recorded` that ran then (a slot
    that freed before `now` took its item while others still ran). An item that would have ended by `now` is still
    running (it has no record): it ends at `now`, holding its share until then."""

    def __init__(self, items: list[_Item], free: list[float], now: float, recorded: _Sharing) -> None:
        self.items, self.now, self.recorded = items, now, recorded
        self.on_start: dict[int, list[int]] = {}  # the items that may start once an item has started
        self.on_end: dict[int, list[int]] = {}  # those that need it ended
        self.blocked: dict[int, int] = {}  # each item not done: its needs not met
        self.starts = {position: item.end for position, item in enumerate(items) if item.end is not None}
        for position, item in enumerate(items):
            if item.end is None:
                needs = [need for need in item.needs if items[need].end is None]
                after = [need for need in item.after_start if items[need].end is None]
                self.blocked[position] = len(needs) + len(after)
                for need in needs:
                    self.on_end.setdefault(need, []).append(position)
                for need in after:
                    self.on_start.setdefault(need, []).append(position)
        self.pending: list[tuple[float, int]] = []  # (ready at, item): every need met
        self.ready: list[tuple[tuple[int, int, int], int]] = []
        self.closed, self.idle = sorted(free), 0  # slots free from a time to come; slots free now
        self.running: dict[int, float] = {}  # item -> its device-seconds left
        self.at = self.closed[0] if self.closed else now
        self.last = max((item.end for item in items if item.end is not None), default=float("-inf"))
        for position in [position for position, count in self.blocked.items() if not count]:
            heapq.heappush(self.pending, (self._ready_at(position), position))

    def _ready_at(self, position: int) -> float:
        item = self.items[position]
        return max(
            [
                float("-inf"),
                *(self._ended(need) for need in item.needs),
                *(self.starts[need] for need in item.after_start),
            ]
        )

    def _ended(self, position: int) -> float:
        end = self.items[position].end
        if end is None:
            raise ValueError(f"item {position} is a need of a ready item and has not ended")
        return end

    def _release(self, dependents: list[int]) -> None:
        for dependent in dependents:
            self.blocked[dependent] -= 1
            if not self.blocked[dependent]:
                heapq.heappush(self.pending, (self._ready_at(dependent), dependent))

    def _end_finished(self) -> None:
        for position in [position for position, left in self.running.items() if not left]:
            del self.running[position]
            self.items[position].end, self.last = self.at, max(self.last, self.at)
            self.idle += 1
            self._release(self.on_end.get(position, []))

    def _start_ready(self) -> None:
        while self.closed and self.closed[0] <= self.at:
            heapq.heappop(self.closed)
            self.idle += 1
        while self.pending and self.pending[0][0] <= self.at or self.idle and self.ready:
            while self.pending and self.pending[0][0] <= self.at:
                _, position = heapq.heappop(self.pending)
                heapq.heappush(self.ready, (_urgency(self.items[position], position), position))
            if self.idle and self.ready:
                _, position = heapq.heappop(self.ready)
                self.running[position], self.starts[position] = self.items[position].seconds, self.at
                self.idle -= 1
                self._release(self.on_start.get(position, []))

    def _share(self) -> int:
        """The items the device is split among from `at` to the next event."""
        return max(self.recorded.floor, len(self.running) + (self.recorded.count(self.at) if self.at < self.now else 0))

    def _next_event(self) -> float | None:
        """The next instant anything changes: an item ends, a slot frees, an item becomes ready, the recorded items
        in flight change."""
        share, working = self._share(), [left for left in self.running.values() if left]
        upcoming = [self.at + min(working) * share] if working else []
        upcoming += [self.now] if self.at < self.now and len(working) < len(self.running) else []  # overdue: `now`
        upcoming += [self.closed[0]] if self.closed else []
        upcoming += [self.pending[0][0]] if self.pending else []
        change = self.recorded.next_change(self.at) if self.at < self.now else None
        upcoming += [min(change, self.now)] if change is not None else []
        return min(upcoming, default=None)

    def _advance(self, to: float) -> None:
        share = self._share()
        for position, left in self.running.items():
            left -= (to - self.at) / share
            # Within a micro-second of done is done: instants since the epoch carry a few tenths of one.
            self.running[position] = left if left > _EPSILON else 0.0
        self.at = to

    def replay(self) -> tuple[float, list[tuple[_Item, float]]]:
        """When the last item ends, and each item in flight at `now` with when it started."""
        while True:
            if self.at >= self.now:
                self._end_finished()
            self._start_ready()
            if self.at >= self.now and not all(self.running.values()):
                continue  # an item of no seconds ends as it starts
            to = self._next_event()
            if to is None:
                break
            self._advance(to)
        in_flight = [(self.items[position], self.starts.get(position, self.now)) for position in self.blocked]
        return self.last, [(item, start) for item, start in in_flight if start < self.now]


def _slots_free(tasks: list[tuple[float, float]], width: int, started: float) -> list[float]:
    """When each of the lane's `width` slots last freed (and took the item in flight on it, if any): all free at
    `started`, each task taking, as it started, the slot that freed latest by then (a slot's freeing is what
    grants the next item), else the earliest. A slot that never freed since holds an item since the start."""
    free = [started] * width
    for start, end in sorted(tasks):
        taken = [at for at in free if at <= start]
        free.remove(max(taken) if taken else min(free))
        free.append(end)
    return sorted(free)


def _stopped_in_flight(
    plan: ClipPlan,
    done: Mapping[Stage, Iterable[str]],
    spans: list[Span],
    earlier: list[Span],
    paces: _Paces,
    floor: int,
) -> list[tuple[float, float]]:
    """The tasks the earlier attempts had in flight when the last of them stopped, each from when its slot last freed
    to that attempt's last record. Killed, they left no record, but the items recorded beside them shared the device
    with them: without them, a decode that ran beside one lost would count as having had the device alone. Which
    items they were is the lane replayed as that attempt saw it: what this run found done, done."""
    tasks = _tasks(plan, earlier)
    if not tasks:
        return []
    computed = {(span.stage, span.item) for span in spans}
    found = {stage: [item for item in items if (stage, item) not in computed] for stage, items in done.items()}
    stopped = max(end for _, end in tasks)
    free = _slots_free(tasks, _width(tasks), min(start for start, _ in tasks))
    ends = {(span.stage, span.item): span.end for span in earlier}
    _, starts = _Lane(_lane_items(plan, found, ends, paces), free, stopped, _Sharing.of(tasks, floor)).replay()
    return [(start, stopped) for _, start in starts]


def seconds_left(
    plan: ClipPlan,
    done: Mapping[Stage, Iterable[str]],
    spans: list[Span],
    now: float,
    started: float,
    earlier: list[Span] | None = None,
    shared: bool = False,
) -> float | None:
    """Seconds until the run of `plan` ends: `done` is each stage's items recorded done, `spans` the items this run
    computed (it started at `started`), `earlier` those earlier attempts of the run computed (their paces stand in
    for a stage this run has not timed yet). `shared`: other clips' items, which these records do not show, take the
    lane's slots this run leaves (an archive's clips in flight together share one model queue), so the device is
    counted full throughout, each item at the pace it was timed at, alone or not.

    None while a model stage with items left has no timing."""
    recent = window_items(plan)
    left = items_left(plan, done)
    timed = [*(earlier or []), *spans]
    tasks = _tasks(plan, spans)
    recorded = [*_tasks(plan, earlier or []), *tasks]
    width = max(_width(tasks), _width(_tasks(plan, earlier or [])))
    floor = width if shared else 1
    paces = _paces(plan, timed, recent, _Sharing.of(recorded, floor))
    if any(left.get(stage, 0) and stage not in paces for stage in MODEL_STAGES):
        return None
    tail = (Stage.BLEND, Stage.SEGMENT, Stage.MUX)
    if not any(left.get(stage, 0) for stage in (*MODEL_STAGES, *tail)):
        return 0.0
    ends = {(span.stage, span.item): span.end for span in spans}
    free = _slots_free(tasks, width, started)
    if earlier:
        recorded += _stopped_in_flight(plan, done, spans, earlier, paces, floor)
        paces = _paces(plan, timed, recent, _Sharing.of(recorded, floor))
    device = _Sharing.of(recorded, floor)
    at, in_flight = _Lane(_lane_items(plan, done, ends, paces), free, now, device).replay()
    if in_flight:
        # The items in flight, which have no records yet, shared the device with the latest recorded ones: counted
        # in, those took less of it than they seemed to (a decode that ran beside one still running is not a lone
        # decode). The lane replayed again at those paces.
        sharing = _Sharing.of([*recorded, *((start, now) for _, start in in_flight)], floor)
        running = [
            (item.stage, sharing.seconds(start, now) / plan.windows[item.window].padded) for item, start in in_flight
        ]
        paces = _paces(plan, timed, recent, sharing, running)
        at, _ = _Lane(_lane_items(plan, done, ends, paces), free, now, device).replay()
    last = plan.windows[-1]
    for stage in tail:
        item = "all" if stage == Stage.MUX else str(last.index)
        if item in set(done.get(stage, ())):
            at = ends.get((stage, item), at)
        else:
            at = max(now, at + paces.get(stage, 0.0) * (1 if stage == Stage.MUX else last.padded))
    return max(0.0, at - now)


@dataclass(frozen=True)
class ClipTime:
    """One clip of an archive as its bar saw it: the seconds since its run began, the seconds it has left
    (`seconds_left`: None before its run has timed each model stage, 0 once it ended), the (window, tile) items it
    computes and those of them done."""

    elapsed: float
    left: float | None
    tiles: int
    done: int = 0


def _clip_left(clip: ClipTime, per_item: float, drawn: bool) -> float:
    """A clip's seconds left in its archive: its own figure (drawn toward its items at `per_item` while few are
    done, where `drawn`), else its items at that pace."""
    prior = max(0.0, clip.tiles * per_item - clip.elapsed)
    if clip.left is None or not clip.left or not drawn:
        return prior if clip.left is None else clip.left
    # The pace's weight falls fast with the items done, so the clip's own figure holds its last minutes.
    weight = (1.0 - min(clip.done, clip.tiles) / max(1, clip.tiles)) ** 2
    return weight * prior + (1.0 - weight) * clip.left


def archive_seconds_left(clips: Iterable[ClipTime], waiting: Iterable[int], parallel: int = 1) -> float | None:
    """Seconds until an archive's clips are all done. `clips`: those run or running; `waiting`: the (window, tile)
    items of each clip not started yet (or whose plan is not recorded yet), counted at the seconds an item took in
    the clips that ended (before one has, in the running clips with a figure: elapsed and left), so the figure goes
    on from one clip to the next rather than restarting at each. A running clip counts its own figure, drawn toward
    its items at that pace while few are done: its first items say little of its pace (the machine's load changes),
    the archive's clips so far more. Clips run `parallel` at once, their items sharing one model queue: an item's
    seconds are of a clip beside others, so the work left is split among them, and never ends before the longest
    clip running. None until a clip has a figure."""
    clips = list(clips)
    ended = [clip for clip in clips if clip.left == 0.0 and clip.tiles]
    timed = ended or [clip for clip in clips if clip.left is not None and clip.tiles]
    if not timed:
        return None
    per_item = sum(clip.elapsed + (clip.left or 0.0) for clip in timed) / sum(clip.tiles for clip in timed)
    running = [_clip_left(clip, per_item, bool(ended)) for clip in clips]
    work = sum(running) + per_item * sum(waiting)
    return max(work / max(1, parallel), max(running, default=0.0))
