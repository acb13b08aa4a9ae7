"""The gate a loaded model's stages pass to share the card: each call holds its share of the memory budget's room
while it runs (`k6vsr_core.model.memory` says what the shares and the room are, and why).

Apart from `k6vsr_core.model.memory` because the bundle holds a gate and the budget module reasons about bundles.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["MemoryGate"]


# A condition variable of our own, not a Dask worker resource or a Prefect concurrency limit: shares are bytes that
# differ per call, the callers are the threads of one process (a command's, a warm worker's, the in-memory runner's),
# and a call that waits must not cost a round trip to a scheduler.
class MemoryGate:
    """Admits a process's model calls while their shares fit the room together, first come first served."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._queue: deque[object] = deque()
        self._taken = 0
        self._running = 0

    @contextmanager
    def hold(self, share: int, room: int) -> Iterator[None]:
        """Run the block once `share` fits beside what runs (always when nothing runs: a stage alone was budgeted
        to fit), and no call that came first still waits."""
        ticket = object()
        with self._changed:
            self._queue.append(ticket)
            self._changed.wait_for(
                lambda: self._queue[0] is ticket and (self._running == 0 or self._taken + share <= room)
            )
            self._queue.popleft()
            self._taken += share
            self._running += 1
            self._changed.notify_all()  # the next in line may fit too
        try:
            yield
        finally:
            with self._changed:
                self._taken -= share
                self._running -= 1
                self._changed.notify_all()

    @property
    def running(self) -> int:
        with self._changed:
            return self._running
