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


def streamed(lines: list[dict], since: float = float("-inf")) -> list[dict]:
    """`lines` as a run that streams its blends writes them: a window's blend line spans from its first decode's end
    (or from `since`, a resumed run's start, where its first decodes were done before) to its own end, its wait
    for the other decodes included."""
    out = []
    for line in lines:
        if line["stage"] == "blend":
            window = line["item"]
            ends = [x["end"] for x in lines if x["stage"] == "decode" and x["item"].split("-")[0] == window]
            line = {**line, "start": max(since, min(ends, default=since))}
        out.append(line)
    return out


def resumed(lines: list[dict], killed_at: float, restarts_at: float) -> tuple[list[dict], list[dict]]:
    """A run killed at `killed_at` and started again at `restarts_at`: the lines of the items that had ended (the
    first attempt's), and those of the others as the second attempt computes them, each as long as it took first,
    the earliest starting as the second attempt starts. What was in flight at the kill is computed again whole."""
    first = [line for line in lines if line["end"] <= killed_at]
    rest = [line for line in lines if line["end"] > killed_at and line["stage"] != "ingest"]
    shift = restarts_at - min(line["start"] for line in rest)
    second = [{**line, "start": line["start"] + shift, "end": line["end"] + shift} for line in rest]
    return first, second


def replay(plan, lines: list[dict], started: float, earlier: list[dict] = (), step: float = 1.0) -> list[tuple]:
    """A run of `plan` replayed `step` by `step` from `started` (when its bar began) to its last line's end, the
    estimator (`storage.time_left.seconds_left`) asked at each instant what the records and the timeline would say
    then: (seconds since `started`, the time the run really had left, the estimate or None)."""
    from storage.time_left import Span, seconds_left

    end = max(line["end"] for line in lines)
    before = [Span.of_line(line) for line in earlier]
    found: dict[str, set[str]] = {}
    for line in earlier:
        found.setdefault(line["stage"], set()).add(line["item"])
    replayed, now = [], started
    while now < end:
        done = {stage: set(items) for stage, items in found.items()}
        past = [line for line in lines if line["end"] <= now]
        for line in past:
            done.setdefault(line["stage"], set()).add(line["item"])
        spans = [Span.of_line(line) for line in past]
        replayed.append((now - started, end - now, seconds_left(plan, done, spans, now, started, before)))
        now += step
    return replayed


def one_after_another(clips: list[list[dict]], gap: float = 5.0) -> list[list[dict]]:
    """Clips' lines (each from 0 s on) as an archive runs them one after another, each starting `gap` seconds after
    the previous clip's last line."""
    runs, at = [], 0.0
    for lines in clips:
        runs.append([{**line, "start": line["start"] + at, "end": line["end"] + at} for line in lines])
        at = max(line["end"] for line in runs[-1]) + gap
    return runs


def replay_archive(clips: list[tuple], step: float = 1.0) -> list[tuple]:
    """An archive of `clips`, each (its plan, its lines on the archive's clock), replayed `step` by `step` from its
    first line to its last: the archive's estimate (`storage.time_left.archive_seconds_left`) at each instant from
    its clips' records then, a running clip's from its own (`seconds_left`), as the archive's screen reads them:
    (seconds since the first line, the time it really had left, the estimate or None)."""
    from storage.time_left import ClipTime, Span, archive_seconds_left, seconds_left

    began_at = min(line["start"] for _, lines in clips for line in lines)
    end, replayed, now = max(line["end"] for _, lines in clips for line in lines), [], began_at
    while now < end:
        seen, waiting = [], []
        for plan, lines in clips:
            tiles = plan.num_windows * plan.num_tiles
            began, ended = min(line["start"] for line in lines), max(line["end"] for line in lines)
            if now >= ended:
                seen.append(ClipTime(ended - began, 0.0, tiles, tiles))
            elif now < began:
                waiting.append(tiles)
            else:
                past = [line for line in lines if line["end"] <= now]
                done: dict[str, set[str]] = {}
                for line in past:
                    done.setdefault(line["stage"], set()).add(line["item"])
                left = seconds_left(plan, done, [Span.of_line(line) for line in past], now, began)
                seen.append(ClipTime(now - began, left, tiles, len(done.get("decode", ()))))
        replayed.append((now - began_at, end - now, archive_seconds_left(seen, waiting)))
        now += step
    return replayed
