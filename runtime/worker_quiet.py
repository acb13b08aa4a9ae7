"""A Dask preload for the local cluster a command starts: a worker that loses its scheduler says nothing about it.

That scheduler lives in the `k6vsr` command itself. When the command is stopped (Ctrl-C, SIGTERM) it writes its
one last line and kills its workers (`entrypoints.stopping`), but a worker caught sending its heartbeat can still log
the failed heartbeat, a traceback, below that line (seen in CI). All that traceback says is that the command is gone.
"""

from __future__ import annotations

import logging
from typing import Any

HEARTBEAT_LOST = "Failed to communicate with scheduler during heartbeat"


class HeartbeatLost(logging.Filter):
    """Drops the worker's report of a heartbeat its scheduler did not answer."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(HEARTBEAT_LOST)


def dask_setup(worker: Any) -> None:
    logging.getLogger("distributed.worker").addFilter(HeartbeatLost())
