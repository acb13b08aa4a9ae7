"""Two malloc arenas for k6vsr's processes, unless `MALLOC_ARENA_MAX` says otherwise.

glibc gives each new thread an arena of its own, up to eight per core, and an arena keeps what was freed in it. An
archive starts threads for every clip (its run's task-runner pool, the lanes), so the command's RSS rose with the
clips done: 101 to 1,362 MiB over 200 one-window clips, 1.4 to 1.6 GiB over 1,000; with two arenas it stayed between
500 and 700 MiB over the same 200 (bench/RESULTS.md). The limit is glibc's own (`mallopt(M_ARENA_MAX)`, what the
environment variable sets as a process starts), set before the command starts its threads, and exported so that
the processes it starts (the Prefect server, Dask workers, job processes) take it as they start.
"""

from __future__ import annotations

import ctypes
import os

ARENAS = 2
ENV = "MALLOC_ARENA_MAX"
M_ARENA_MAX = -8  # glibc's malloc.h


def limit_malloc_arenas() -> int | None:
    """Limit this process's malloc arenas to `ARENAS` and export the limit; the limit set, or None where the user
    set one (glibc read it as the process started) or the C library is not glibc."""
    if ENV in os.environ:
        return None
    os.environ[ENV] = str(ARENAS)
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (OSError, AttributeError):  # no mallopt: not glibc, nothing to set
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return ARENAS if mallopt(M_ARENA_MAX, ARENAS) == 1 else None
