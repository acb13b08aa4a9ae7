"""A full disk, as the HTTP server meets it: which errors are one, and whether the store's disk is full now.

A write that fails for want of space costs the request or the job that made it (507 `disk_full` for an upload, a
job failed with `disk_full`), never the server: the job worker lives on, a record it could not write is kept in
memory until it can be (`records.JobStore`), and `/health` says the disk is full until a write succeeds again.
"""

from __future__ import annotations

import threading
import time

from storage.disk import is_no_space

__all__ = ["DISK_FULL_MESSAGE", "DiskState", "is_disk_full"]

DISK_FULL_MESSAGE = "the server's disk is full"


def is_disk_full(err: BaseException | None) -> bool:
    """Whether `err`, or an error it was raised from, is a write that found no space (`storage.disk.DiskFull`
    included: what a job's run raises for its store's full disk)."""
    return is_no_space(err)


class DiskState:
    """Whether the store's disk was found full: set by a write that found no space, cleared by the next write that
    succeeds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.full_since: float | None = None  # time.time() of the first failed write since the last success

    @property
    def full(self) -> bool:
        return self.full_since is not None

    def hit(self) -> None:
        with self._lock:
            if self.full_since is None:
                self.full_since = time.time()

    def ok(self) -> None:
        with self._lock:
            self.full_since = None
