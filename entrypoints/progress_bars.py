"""The terminal's progress displays: a clip run's bar over every (window, tile) item, with its stage, window and time
left; an archive's clips done, failed and left, with the bar of the clip it runs.

What a bar says is the store's (`storage.progress`), the same words as the run's progress artifact in the Prefect UI.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from tqdm import tqdm

from k6vsr_core.contract.plan import ClipPlan
from service.runs import PreparedRun
from storage import RunRef, RunStore
from storage.progress import (
    SEPARATOR,
    RunProgress,
    clip_text,
    clips_text,
    polling,
    read_progress,
    stage_items,
    stored_plan,
)
from storage.time_left import ClipTime, Span, archive_seconds_left, seconds_left

POLL_S = 0.5  # the bar redraws this often: its elapsed time and time left move every second
# The time left is the store's estimate (`storage.time_left`), from what this run computes, not what it found done.
BAR_FORMAT = "{desc} |{bar}| {elapsed} elapsed{postfix}"


def left_text(seconds: float | None) -> str:
    """`00:12 left`, or `? left` while there is no estimate."""
    return f"{'?' if seconds is None else tqdm.format_interval(seconds)} left"


class RunBar:
    """One clip run's bar: `decode · window 2 of 3 · 7 of 18 tiles |####      | 01:10 elapsed, 00:12 left`."""

    def __init__(
        self,
        store: RunStore,
        plan: ClipPlan,
        file: IO[str],
        name: str = "",
        position: int = 0,
        clock: Callable[[], float] = time.time,
        time_left: bool = True,
        shared: bool = False,
    ) -> None:
        """`name`: the clip's, shown first (an archive's clip bar). Items recorded before the bar began were found
        done: they say nothing of this run's pace, but the timeline's lines of them stand in for it until this run
        has timed each stage (`storage.time_left`). `shared`: other clips compute beside it on the same model queue
        (an archive's, several clips at once)."""
        self.store, self.plan, self.name, self.clock, self.position = store, plan, name, clock, position
        self.shared = shared
        self.time_left = time_left  # off for a preview: it computes a few windows, not the plan's items left
        self.since = clock()
        self.seen: set[tuple[str, str]] = set()  # (stage, item) records read already
        self.spans: list[Span] = []  # the items this run computed
        lines = [Span.of_line(line) for line in store.records.timeline()]
        self.earlier = [span for span in lines if span is not None and span.end < self.since]
        progress = read_progress(store, plan)
        self.found = progress.decoded  # the (window, tile) items done before this run
        self.tiles = progress.total - progress.decoded  # those this run computes
        self.left: float | None = None  # the latest estimate
        self.bar = tqdm(
            total=progress.total,
            initial=progress.decoded,
            file=file,
            leave=False,
            position=position,
            bar_format=BAR_FORMAT,
            desc=self._text(progress),
            postfix="? left" if time_left else None,
        )

    def _text(self, progress: RunProgress) -> str:
        return clip_text(self.name, progress) if self.name else progress.text()

    def _time_left(self) -> str:
        """`00:12 left`, or `? left` before the run has timed each model stage it has items left in."""
        records = self.store.records
        done = {stage: records.items(stage) for stage in stage_items(self.plan)}
        for stage, items in done.items():
            for item in items:
                if (stage, item) in self.seen:
                    continue
                self.seen.add((stage, item))
                record = records.read(stage, item)
                if record is not None and record.seconds > 0 and record.written_at >= self.since:
                    self.spans.append(Span.of(record))
        self.left = seconds_left(self.plan, done, self.spans, self.clock(), self.since, self.earlier, self.shared)
        return left_text(self.left)

    def show(self) -> None:
        left = self._time_left()
        # The stage a window's time goes to, at the seconds its items took (a decode may take ten denoises').
        seconds: dict[str, list[float]] = {}
        for span in [*self.earlier, *self.spans]:
            seconds.setdefault(span.stage, []).append(span.end - span.start)
        paces = {stage: sum(values) / len(values) for stage, values in seconds.items()}
        progress = read_progress(self.store, self.plan, paces)
        self.bar.set_description_str(self._text(progress), refresh=False)
        if self.time_left:
            self.bar.set_postfix_str(left, refresh=False)
        self.bar.update(progress.decoded - self.bar.n)
        self.bar.refresh()

    def timing(self, ended: bool = False) -> ClipTime:
        """What the archive's time left counts of this clip (`ended`: its run is over, done or failed; its pace is
        then that of the items it computed, none for a clip that failed at once)."""
        if ended:
            done = read_progress(self.store, self.plan).decoded - self.found
            return ClipTime(self.clock() - self.since, 0.0, done, done)
        return ClipTime(self.clock() - self.since, self.left, self.tiles, min(self.tiles, int(self.bar.n) - self.found))

    def close(self) -> None:
        self.bar.close()


@contextmanager
def run_progress(prepared: PreparedRun, enabled: bool = True, time_left: bool = True) -> Iterator[None]:
    """While the block runs, the run's bar on a terminal's stderr (without a time left: a preview's)."""
    if not enabled or not sys.stderr.isatty():
        yield
        return
    bar = RunBar(prepared.run.open(), prepared.plan, sys.stderr, time_left=time_left)
    try:
        with polling(bar.show, "k6vsr-progress", POLL_S):
            yield
    finally:
        bar.close()


class ArchiveBars:
    """An archive's lines: `clips: 1 done, 0 failed, 2 left`, and below it a bar for each clip it runs.

    Read from the archive's manifest (rewritten as each clip ends; one older than `since` is a previous run's, and
    not read) and from the clips' run stores. Clips start in the manifest's order, `parallel` at once: those running
    are its first `parallel` clips still `planned`. The clips' line says the archive's time left: the running clips'
    and, for the clips still to run, their items at the seconds an item took so far (`archive_seconds_left`)."""

    def __init__(
        self, manifest: Path, file: IO[str], since: float, parallel: int = 1, clock: Callable[[], float] = time.time
    ) -> None:
        self.manifest, self.file, self.since, self.parallel, self.clock = manifest, file, since, parallel, clock
        self.clips = tqdm(total=0, file=file, leave=False, position=0, bar_format=BAR_FORMAT)
        self.clips.set_description_str("planning the clips")
        self.bars: dict[str, RunBar] = {}  # relative path -> the bar of a running clip whose plan is recorded
        self.ended: list[ClipTime] = []  # the clips whose bars this display closed: their runs are over

    def show(self) -> None:
        try:
            if self.manifest.stat().st_mtime < self.since:
                return
            manifest = json.loads(self.manifest.read_text())
            rows, store_root = manifest["rows"], manifest["store_root"]
        except (OSError, ValueError, KeyError):  # not written yet, or being replaced
            return
        statuses = [row["status"] for row in rows]
        done, failed, left = statuses.count("done"), statuses.count("failed"), statuses.count("planned")
        running = [(row["relative_path"], row["run_key"]) for row in rows if row["status"] == "planned"]
        running = running[: self.parallel]
        for path in [path for path in self.bars if path not in dict(running)]:
            bar = self.bars.pop(path)
            self.ended.append(bar.timing(ended=True))
            bar.close()
        text = clips_text(done, failed, left)
        for path, run_key in running:
            if path in self.bars:
                continue
            store = RunRef(store_root=str(store_root), run_key=run_key).open()
            plan = stored_plan(store)
            if plan is None:  # its ingest has not recorded the clip's plan yet
                text += SEPARATOR + clip_text(path, None)
                continue
            used = {bar.position for bar in self.bars.values()}
            position = next(line for line in range(1, len(self.bars) + 2) if line not in used)
            # Clips in flight together share the model queue: each clip's items beside others' it cannot see.
            shared = self.parallel > 1
            self.bars[path] = RunBar(
                store, plan, self.file, name=path, position=position, clock=self.clock, shared=shared
            )
        for bar in self.bars.values():
            bar.show()
        # The clips still to run, and those running whose plan is not recorded yet: their (window, tile) items; none
        # for a clip of a run done already (the same source twice), which finds its items done.
        finished = {row["run_key"] for row in rows if row["status"] in ("done", "reused")}
        waiting = [
            0 if row["run_key"] in finished else row.get("tiles") or 0
            for row in rows
            if row["status"] == "planned" and row["relative_path"] not in self.bars
        ]
        clips = [*self.ended, *(bar.timing() for bar in self.bars.values())]
        self.clips.total = done + failed + left
        self.clips.set_description_str(text, refresh=False)
        self.clips.set_postfix_str(left_text(archive_seconds_left(clips, waiting, self.parallel)), refresh=False)
        self.clips.update(done + failed - self.clips.n)
        self.clips.refresh()

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        self.bars.clear()
        self.clips.close()


@contextmanager
def archive_progress(manifest: Path, parallel: int = 1, enabled: bool = True) -> Iterator[None]:
    """While the block runs, the archive's lines on a terminal's stderr (a bar for each of the `parallel` clips that
    run at once); nothing stays after it."""
    if not enabled or not sys.stderr.isatty():
        yield
        return
    bars = ArchiveBars(manifest, sys.stderr, since=time.time(), parallel=parallel)
    try:
        with polling(bars.show, "k6vsr-archive-progress", POLL_S):
            yield
    finally:
        bars.close()
