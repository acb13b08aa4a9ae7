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
