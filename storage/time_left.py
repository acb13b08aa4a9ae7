"""The time a clip run has left, from what this run measured and what its plan has left to do.

The plan knows every item (`storage.progress.stage_items`); the records say which are done and, for those this run
computed, when each ran. The model's stages (encode, denoise, decode) share the model lane, a few items at once, and
hold the run back: what is left is their items not done, at each stage's seconds per item over its latest window
(the machine's pace now: another process's load changes it within a run), over the lane's width (the most items
seen running at once),
then the last window's blend, segment and mux, which nothing overlaps. CPU stages of earlier windows run beside the
model lane and add nothing.

The estimate is made when an item ends and counts down between ends, so the terminal shows a time that moves every
second and corrects itself as items finish. It is None (`? left`) until every model stage with items left has
been measured in this run: a first window's decode cannot be guessed from its encode.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from k6vsr_core.plan import ClipPlan
from k6vsr_core.stage_names import CPU_STAGES, MODEL_STAGES, Stage
from storage.progress import stage_items
from storage.records import CompletionRecord

TAIL_STAGES = (*CPU_STAGES, Stage.MUX)  # of the last window: after its last decode, nothing beside them


@dataclass(frozen=True)
class Span:
    """One item this run computed: its stage and when it ran (seconds since the epoch)."""

    stage: str
    start: float
    end: float

    @classmethod
    def of(cls, record: CompletionRecord) -> Span:
        return cls(record.stage, record.written_at - record.seconds, record.written_at)


def _means(spans: Iterable[Span], recent: Mapping[str, int]) -> dict[str, float]:
    """Each stage's seconds per item over its `recent[stage]` latest items (all without one): the machine's pace
    now, which another process's load changes within a run."""
    totals: dict[str, list[float]] = {}
    for span in sorted(spans, key=lambda span: span.end):
        totals.setdefault(span.stage, []).append(span.end - span.start)
    kept = {stage: seconds[-recent.get(stage, len(seconds)) :] for stage, seconds in totals.items()}
    return {stage: sum(seconds) / len(seconds) for stage, seconds in kept.items()}


def seconds_left(
    left: Mapping[str, int], spans: list[Span], now: float, recent: Mapping[str, int] | None = None
) -> float | None:
    """Seconds until the run ends: `left` is each stage's items not done yet, `spans` the items this run computed,
    `recent` how many of a stage's latest items give its pace (`window_items`; all by default).

    None while a model stage with items left has no measurement."""
    model = [span for span in spans if span.stage in MODEL_STAGES]
    means = _means(spans, recent or {})
    if any(left.get(stage, 0) and stage not in means for stage in MODEL_STAGES):
        return None
    if not any(left.get(stage, 0) for stage in (*MODEL_STAGES, *TAIL_STAGES)):
        return 0.0
    tail = sum(means.get(stage, 0.0) for stage in TAIL_STAGES if left.get(stage, 0))
    if not model:  # only CPU stages are left, none of them measured beside the model lane
        return tail
    # The lane's width: the most of its items seen running at once. (Its busy seconds over the wall clock read low
    # whenever an item is in flight, which the records cannot show until it ends.)
    last = max(span.end for span in spans)
    concurrency = max(sum(other.start <= (span.start + span.end) / 2 <= other.end for other in model) for span in model)
    work = sum(left.get(stage, 0) * means[stage] for stage in MODEL_STAGES if left.get(stage, 0))
    # Made when the last item ended; counted down since.
    return max(0.0, work / concurrency + tail - (now - last))


def window_items(plan: ClipPlan) -> dict[str, int]:
    """Each recorded stage's items in one window: the latest window's pace is the one `seconds_left` counts with."""
    return {stage: max(1, len(items) // plan.num_windows) for stage, items in stage_items(plan).items()}


def items_left(plan: ClipPlan, done: Mapping[str, Iterable[str]]) -> dict[str, int]:
    """Each recorded stage's items of `plan` not in `done` (the items recorded done, by stage)."""
    return {stage: len(set(items) - set(done.get(stage, ()))) for stage, items in stage_items(plan).items()}
