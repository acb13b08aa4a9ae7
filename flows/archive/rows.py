"""The archive's rows: one per clip, what was (or will be) done with it, and what they add up to."""

from __future__ import annotations

from collections import Counter
from typing import Literal, get_args

from pydantic import BaseModel

from k6vsr_core.errors import describe_error

REASON_LIMIT = 2000
Status = Literal["done", "reused", "failed", "skipped", "planned"]
STATUSES: tuple[Status, ...] = get_args(Status)


class ArchiveRow(BaseModel):
    """One clip of the archive: what was (or will be) done with it."""

    source: str
    relative_path: str
    status: Status
    reason: str = ""
    run_key: str = ""
    frames: int | None = None
    tiles: int | None = None
    tiles_computed: int | None = None
    tiles_reused: int | None = None
    seconds: float | None = None
    output: str = ""


class ArchiveSummary(BaseModel):
    input: str
    output_dir: str
    counts: dict[str, int]
    message: str
    manifest_json: str
    manifest_csv: str
    failed: bool
    rows: list[ArchiveRow]


def counts_of(rows: list[ArchiveRow]) -> dict[str, int]:
    counted = Counter(row.status for row in rows)
    return {status: counted[status] for status in STATUSES if counted[status]}


def message_of(rows: list[ArchiveRow], plan_only: bool) -> str:
    if not rows:
        return "no clips found"
    counts = counts_of(rows)
    listed = ", ".join(f"{n} {status}" for status, n in counts.items())
    if plan_only:
        return f"plan only, nothing run: {listed}"
    if not any(counts.get(status) for status in ("done", "failed", "planned")):
        return f"nothing new to do: {listed}"
    return listed


def reason_of(err: BaseException) -> str:
    """A row's reason: the user's one line, or the internal error's type and message."""
    return (describe_error(err) or f"{type(err).__name__}: {err}")[:REASON_LIMIT]
