"""A Dask preload for the workers a command (or the warm workers) starts: a worker whose parent is gone ends at once,
and says nothing of it.

The scheduler of a command's local cluster lives in the `k6vsr` command itself. When the command is stopped (Ctrl-C,
SIGTERM) it writes its one last line and kills its workers (`entrypoints.stopping`), but two things could still
write below that line (both seen in CI): a worker caught sending its heartbeat logs the failed heartbeat with a
traceback, and a worker that a nanny thread of the command restarted after the kill list was taken lives on to log
"Stopping worker ... scheduler-connection-broken". All either says is that the command is gone. A command killed
with SIGKILL, which nothing can catch, would likewise leave its workers computing (holding a GPU) until their tile
ends: each worker therefore watches its parent process and exits the moment it is gone.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from typing import Any

HEARTBEAT_LOST = "Failed to communicate with scheduler during heartbeat"


def parent_alive() -> bool:
    """Whether the process that started this one still runs (always, for a worker in the command's own process)."""
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


class HeartbeatLost(logging.Filter):
    """Drops the worker's report of a heartbeat its scheduler did not answer, and everything once its parent is gone."""

    def filter(self, record: logging.LogRecord) -> bool:
        return parent_alive() and not record.getMessage().startswith(HEARTBEAT_LOST)


def exit_with_parent() -> threading.Thread | None:
    """A daemon thread that ends this process as soon as its parent's lifeline closes (the parent exited, however).

    A worker in threads of the command itself has no parent process of its own and gets none."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return None

    def watch() -> None:
        parent.join()  # returns when the pipe the parent holds open closes: its exit, kill -9 included
        os._exit(0)  # not sys.exit: the worker's threads may be computing a tile nobody will read

    thread = threading.Thread(target=watch, daemon=True, name="k6vsr-parent-watch")
    thread.start()
    return thread


def dask_setup(worker: Any) -> None:
    # On the handlers, not a logger: a filter on a logger sees only what that logger itself logs, and the worker's
    # other loggers (`distributed.core`: "Connection to ... has been closed", seen below the line in CI) reach the
    # same terminal through these handlers.
    quiet = HeartbeatLost()
    for name in (None, "distributed"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(quiet)
    exit_with_parent()
