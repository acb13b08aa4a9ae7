"""Fair shares of what the HTTP API's clients wait for: places of the queue and upload slots (`FairShare`), and the
workers' turns (`FairQueue`). An owner is a key's id, or without keys a client address's.

No web framework and no job records here: the runner (`entrypoints.server.job_runner`) counts what each owner holds and
asks these; they hold the rule only, so it is tested on its own.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import TypeVar

Owner = TypeVar("Owner", bound=Hashable)  # whatever a caller keys holdings by: an API key, or None for none

# The queue takes up to this many times its size: a key that arrives at a queue the others fill within their shares
# gets its own share (its place comes out of what they hold past theirs), and no number of keys goes past this.
OVERFLOW = 2


class OverShare(Exception):
    """The owner already holds its share: `share` of the `size` places while `holders` owners hold some (itself
    counted), or `cap` when the owner's own limit is what binds."""

    def __init__(self, share: int, size: int, holders: int, capped: bool) -> None:
        reason = f"its limit of {share}" if capped else f"its share of {size} places shared by {holders} waiting"
        super().__init__(f"already holds {share} places: {reason}")
        self.share, self.size, self.holders, self.capped = share, size, holders, capped


class PoolFull(Exception):
    """Every place is taken within its holder's share (more owners wait than there are places), or the queue is at
    `OVERFLOW` times its size."""

    def __init__(self, size: int) -> None:
        super().__init__(f"all {size} places are taken")
        self.size = size


@dataclass(frozen=True)
class FairShare:
    """`size` places shared by the owners that hold any: each owner's share is `size // holders` (at least 1, and at
    most `cap`), the asking owner counted among the holders.

    An owner below its share is taken even when the places are all taken, as long as the others hold them past
    their own shares (they may take no more until theirs shrink below); so a lone owner may take all `size`, and a
    second one still gets its half. An owner at its share is refused only while another owner holds places (or at
    `cap`); at most `OVERFLOW * size` places are ever taken."""

    size: int
    cap: int | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or (self.cap is not None and self.cap < 1):
            raise ValueError(f"a fair share needs at least one place and a cap of one, not {self.size}, {self.cap}")

    def holders(self, holdings: Mapping[Owner, int], owner: Owner) -> int:
        return len({who for who, held in holdings.items() if held > 0} | {owner})

    def share(self, holdings: Mapping[Owner, int], owner: Owner) -> int:
        """How many places `owner` may hold while the others hold `holdings`."""
        fair = max(1, self.size // self.holders(holdings, owner))
        return fair if self.cap is None else min(fair, self.cap)

    def check(self, holdings: Mapping[Owner, int], owner: Owner) -> None:
        """Whether `owner` may take one more place: `OverShare` or `PoolFull` when not."""
        holders = self.holders(holdings, owner)
        fair = max(1, self.size // holders)
        share = fair if self.cap is None else min(fair, self.cap)
        held = holdings.get(owner, 0)
        capped = share < fair
        if held >= share and (holders > 1 or capped):
            raise OverShare(share, self.size, holders, capped)
        # The places taken within their holders' shares: what a newcomer's place may not come out of.
        within = held + sum(min(count, fair) for who, count in holdings.items() if who != owner)
        if within >= self.size or sum(holdings.values()) >= OVERFLOW * self.size:
            raise PoolFull(self.size)


class FairQueue:
    """Jobs waiting for a worker, handed out in turns across their owners: the next is the oldest job of the owner
    that started a job least recently (an owner that never started one first), so an owner with one job never waits
    behind another's backlog, and two owners with many alternate.

    Thread-safe; `get` blocks until a job waits or the queue is closed."""

    # Owners whose last start is remembered; past it the least recent are forgotten, which only moves them to where
    # they nearly are anyway: first in line.
    REMEMBERED = 4096

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._jobs: dict[Hashable, list[tuple[int, str]]] = {}  # owner -> (arrival, job), oldest first
        self._owners: dict[str, Hashable] = {}
        self._started: dict[Hashable, int] = {}  # owner -> the turn its last job started at
        self._ticks = itertools.count()
        self._closed = False

    def put(self, job: str, owner: Hashable) -> None:
        with self._changed:
            if job in self._owners:
                return
            self._jobs.setdefault(owner, []).append((next(self._ticks), job))
            self._owners[job] = owner
            self._changed.notify()

    def remove(self, job: str) -> bool:
        """Take `job` out (cancelled before it started); False when it no longer waits."""
        with self._changed:
            owner = self._owners.pop(job, _ABSENT)
            if owner is _ABSENT:
                return False
            jobs = self._jobs[owner]
            jobs[:] = [entry for entry in jobs if entry[1] != job]
            if not jobs:
                del self._jobs[owner]
            return True

    def get(self, timeout: float | None = None) -> str | None:
        """The next job to start, taken out of the queue and its owner's turn counted; None once the queue is closed
        (or after `timeout` seconds with nothing waiting)."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._closed or self._jobs, timeout=timeout) or self._closed:
                return None
            owner = min(self._jobs, key=lambda who: (self._started.get(who, -1), self._jobs[who][0][0]))
            jobs = self._jobs[owner]
            _, job = jobs.pop(0)
            if not jobs:
                del self._jobs[owner]
            del self._owners[job]
            self._started.pop(owner, None)  # re-inserted last: the dict stays in order of last start
            self._started[owner] = next(self._ticks)
            while len(self._started) > self.REMEMBERED:
                del self._started[next(iter(self._started))]
            return job

    def close(self) -> None:
        """Wake every `get`, now and later, with None: the server stops."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def counts(self) -> dict[Hashable, int]:
        """Jobs waiting, by owner."""
        with self._changed:
            return {owner: len(jobs) for owner, jobs in self._jobs.items()}

    def __len__(self) -> int:
        with self._changed:
            return len(self._owners)

    def __contains__(self, job: object) -> bool:
        with self._changed:
            return job in self._owners


_ABSENT = object()
