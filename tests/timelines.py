"""What a run's `timeline.jsonl` says of when its tasks ran (storage.records writes a line per computed item)."""

from __future__ import annotations

import json
from pathlib import Path


def spans(run_dir: Path, attempt: str | None = None) -> dict[tuple[str, str], tuple[float, float]]:
    """(stage, item) -> (start, end) in seconds since the epoch, of `attempt`'s items (all attempts' if None)."""
    lines = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    return {
        (line["stage"], line["item"]): (line["start"], line["end"])
        for line in lines
        if attempt is None or line["attempt"] == attempt
    }


def of_window(spans_: dict[tuple[str, str], tuple[float, float]], stages: tuple[str, ...], window: int) -> list:
    """The spans of `stages`' items of `window` (items named `<window>` or `<window>-<tile>`)."""
    return [span for (stage, item), span in spans_.items() if stage in stages and item.split("-")[0] == str(window)]


MODEL_STAGES = ("encode", "denoise", "decode")


def lines_of(run_dirs: list[Path]) -> list[dict]:
    """Every timeline line of these runs."""
    return [json.loads(line) for run in run_dirs for line in (run / "timeline.jsonl").read_text().splitlines()]


def covered(intervals: list[tuple[float, float]]) -> float:
    """Seconds of the union of `intervals`."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def next_ready(intervals: list[tuple[float, float]]) -> float:
    """The share of items (all but the last to end) at whose end another item was already under way: the next one
    was ready before the device was free."""
    ends = sorted(intervals, key=lambda span: span[1])[:-1]
    ready = sum(any(s < end < e for s, e in intervals) for _, end in ends)
    return ready / max(1, len(ends))
