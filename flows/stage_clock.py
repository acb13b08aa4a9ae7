"""When each stage of a clip run ran, on the run's own wall clock.

Adding up task times misleads once tasks overlap: six decodes of 2.5 s that run beside the denoising of later chunks
read as a 15 s decode stage in a 12 s run. So the clock keeps each task's interval (it ends when the flow learns of
its end; it started that many seconds earlier, as the task measured itself) and reports per stage:

- `starts`, `ends`: the first start and the last end of the stage's tasks, in seconds from the run's start;
- `adds`: from the end of the stage before (in pipeline order) to the end of this one, i.e. what the stage added
  to the run. Stages overlap (a tile decodes while the next chunk denoises), so spans can add up to more than the
  run, but `adds` never does: its sum is the last stage's end.

Stages that resume a finished run report a zero-length task (nothing computed) at the moment it returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from k6vsr_core.contract.stage_names import PIPELINE, Stage

# The report's order: the pipeline's, with the windows' parts of the quality report where they run (after each
# window's segment, before the mux); the join of the parts after the publish adds to the same row.
REPORT_ORDER = (*PIPELINE[: PIPELINE.index(Stage.MUX)], Stage.QUALITY, *PIPELINE[PIPELINE.index(Stage.MUX) :])

__all__ = ["PIPELINE", "REPORT_ORDER", "StageClock", "StageSpan"]


@dataclass(frozen=True)
class StageSpan:
    stage: str
    starts: float
    ends: float
    adds: float
    tasks: int

    @property
    def span(self) -> float:
        return self.ends - self.starts


class StageClock:
    def __init__(self, now: Callable[[], float] = time.time) -> None:
        self._now = now
        self.started_at = now()
        self._tasks: list[tuple[str, float, float]] = []  # (stage, seconds worked, end from the run's start)

    def finished(self, stage: str, seconds: float, ends_before: float = 0.0) -> None:
        """A task of `stage` has just finished after working `seconds` (0 when it found its work done); or, for a
        stage that a task ran before others, its work ended `ends_before` seconds before the task's end, now."""
        self._tasks.append((stage, seconds, max(0.0, self.elapsed() - ends_before)))

    def elapsed(self) -> float:
        return self._now() - self.started_at

    def task_seconds(self) -> dict[str, float]:
        """Each stage's task times added up, in pipeline order: the work done, not the wall time it took."""
        totals: dict[str, float] = {}
        for stage, seconds, _ in self._tasks:
            totals[stage] = totals.get(stage, 0.0) + seconds
        return {stage: totals[stage] for stage in sorted(totals, key=_pipeline_position)}

    def spans(self) -> list[StageSpan]:
        """One span per stage that ran, in `REPORT_ORDER` (stages it does not name come last)."""
        intervals: dict[str, list[tuple[float, float]]] = {}
        for stage, seconds, end in self._tasks:
            # To the hundredth of a second first, so that the figures as printed add up exactly.
            intervals.setdefault(stage, []).append((round(max(0.0, end - seconds), 2), round(end, 2)))
        spans, reached = [], 0.0
        for stage in sorted(intervals, key=_pipeline_position):
            starts, ends = min(start for start, _ in intervals[stage]), max(end for _, end in intervals[stage])
            spans.append(StageSpan(stage, starts, ends, max(0.0, ends - reached), len(intervals[stage])))
            reached = max(reached, ends)
        return spans


def _pipeline_position(stage: str) -> tuple[int, str]:
    return (REPORT_ORDER.index(stage), "") if stage in REPORT_ORDER else (len(REPORT_ORDER), stage)
