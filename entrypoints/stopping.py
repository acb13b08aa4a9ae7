"""How a `k6vsr` command stops on Ctrl-C or SIGTERM: within seconds, with one line, leaving the truth behind.

It does not wait for the tiles in flight (`runtime.interrupts` says why): it ends the processes it started (a local
Dask cluster's workers) and exits with 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM); a helper it
leaves behind for a moment marks its flow runs and their unfinished task runs Cancelled in Prefect once it is gone.
What was finished is in the run store, which a rerun resumes; what was being written sits under a temporary name,
as after a kill -9, which the store survives.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import NoReturn

from runtime import interrupts

MESSAGE = "interrupted; finished items are kept, rerun to resume"
RESOURCE_TRACKER = b"multiprocessing.resource_tracker"
QUIET_TRACKER = "ignore::UserWarning:multiprocessing.resource_tracker"


@contextlib.contextmanager
def stop_on_interrupt() -> Iterator[None]:
    """For the block: SIGTERM raises as Ctrl-C does, and an interrupt in a flow's body stops the command there."""
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    interrupts.on_interrupt(stop)
    # The resource tracker that a local Dask cluster starts outlives a stop by a moment, and then reports the
    # semaphores of the killed workers as it frees them: a warning after the one line, about nothing to be done.
    if QUIET_TRACKER not in os.environ.get("PYTHONWARNINGS", ""):
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, (os.environ.get("PYTHONWARNINGS"), QUIET_TRACKER)))
    try:
        yield
    finally:
        interrupts.on_interrupt(None)
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupted(signum: int, frame: FrameType | None) -> NoReturn:
    raise interrupts.Interrupted(signum)


def stop(signum: int) -> NoReturn:
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not break the stop into a traceback
        with contextlib.suppress(ValueError):  # outside the main thread, where no interrupt is raised anyway
            signal.signal(sig, signal.SIG_IGN)
    # The one line is the last. What this command started is frozen before it is written (a Dask worker that was
    # printing a warning went on below it), and killed after; a Dask scheduler in this process would log the workers
    # it loses below it.
    children = _freeze_descendants()
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")
    # Written past Python's buffers: this may run inside a signal handler that interrupted a write to them.
    with contextlib.suppress(RuntimeError, ValueError, OSError):
        sys.stdout.flush()
        sys.stderr.flush()
    fresh_line = "\n" if sys.stderr.isatty() else ""  # after the progress bar or the terminal's ^C
    with contextlib.suppress(OSError):
        os.write(2, f"{fresh_line}k6vsr: {MESSAGE}\n".encode())
    # Started after the list of what to kill was taken, and kept off the second: it outlives this process.
    helper = _end_runs_after_exit(signum) if "runtime.flow_leases" in sys.modules else None  # else no flow ran
    _send(children, signal.SIGKILL)
    # A nanny thread of this process may have started a worker after the list was taken.
    _send([pid for pid in _descendants(os.getpid(), apart=helper) if pid not in children], signal.SIGKILL)
    # Not `sys.exit`: the interpreter would wait for the threads still computing tiles, which nothing can stop.
    os._exit(128 + signum)


def _end_runs_after_exit(signum: int) -> int | None:
    """Start the helper that marks this command's runs Cancelled once it has exited (`end_leased_runs`): in its own
    session, so that a second Ctrl-C does not reach it, and silent, so that the one line stays the last."""
    how = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    reason = f"the k6vsr command was interrupted ({how}); finished items are kept, rerun to resume"
    code = f"from runtime.flow_leases import end_leased_runs; end_leased_runs({os.getpid()}, {reason!r})"
    try:
        return subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        ).pid
    except OSError:  # the next command marks them Crashed instead
        return None


def _send(pids: list[int], sig: int) -> None:
    """Signal each of `pids`, gone or not.

    Used on every process this one started, and theirs: first SIGSTOP, then SIGKILL. Dask workers computing tiles
    are killed, which the store survives as it survives a kill -9 of the command. A gentler signal would only give
    a nanny time to restart them. All are stopped before any is killed: a worker that outlived its nanny by a moment
    would see the connection reset and print a traceback on the terminal, below the one line.

    Python's resource tracker is not among them (`_descendants`): it exits by itself when this process does, after
    freeing the shared memory the workers left, and killed it would only be relaunched, to print errors about what
    it never saw."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _freeze_descendants(rounds: int = 5) -> list[int]:
    """Stop every process this one started, and theirs, listing them again until no new one appears: this process's
    other threads (a Dask nanny's) keep running and may start a worker while the list is being taken."""
    frozen: list[int] = []
    for _ in range(rounds):
        new = [pid for pid in _descendants(os.getpid()) if pid not in frozen]
        if not new:
            break
        _send(new, signal.SIGSTOP)
        frozen.extend(new)
    return frozen


def _descendants(root: int, apart: int | None = None) -> list[int]:
    """The processes under `root` but not `apart` or its own, Python's resource tracker left out."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone
                continue
            if _is_resource_tracker(entry):
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    found: list[int] = []
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid != apart]
        found.extend(children)
        frontier.extend(children)
    return found


def _is_resource_tracker(proc: Path) -> bool:
    """Whether `proc` is Python's resource tracker. A command line that cannot be read (the process is exiting, or
    its memory is busy being mapped) says no: a process left out of the list would outlive the stop."""
    try:
        return RESOURCE_TRACKER in (proc / "cmdline").read_bytes()
    except OSError:
        return False
