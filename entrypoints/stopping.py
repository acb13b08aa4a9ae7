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
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import NoReturn

from runtime import interrupts

MESSAGE = "interrupted; finished items are kept, rerun to resume"
RESOURCE_TRACKER = b"multiprocessing.resource_tracker"
QUIET_TRACKER = "ignore::UserWarning:multiprocessing.resource_tracker"
STOPPED_OR_GONE = {"T", "t", "Z", "X"}  # /proc/<pid>/stat's state


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
    # The one line is the last. Whatever could write below it is silenced first: this process's other threads
    # (the progress bar, a Dask scheduler logging the workers it loses) and every process it started, frozen.
    # The helper outlives this process, apart from the rest; it writes nowhere.
    helper = _end_runs_after_exit(signum) if "runtime.flow_leases" in sys.modules else None  # else no flow ran
    _forbid_new_processes()
    children = _freeze_descendants(apart=helper)
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")
    fresh_line = "\n" if sys.stderr.isatty() else ""  # after the progress bar or the terminal's ^C
    terminal = _take_stderr()
    with contextlib.suppress(OSError):
        os.write(terminal, f"{fresh_line}k6vsr: {MESSAGE}\n".encode())
    _send(children, signal.SIGKILL)
    _send([pid for pid in _descendants(os.getpid(), apart=helper) if pid not in children], signal.SIGKILL)
    # Not `sys.exit`: the interpreter would wait for the threads still computing tiles, which nothing can stop.
    os._exit(128 + signum)


def _forbid_new_processes() -> None:
    """From now on a thread of this process that starts a process waits forever instead, until the exit.

    A Dask nanny's thread restarts the worker it sees killed, within milliseconds; started after the last list of
    what to kill, that worker would outlive the command and write below its last line. Every way Python starts a
    process ends in one of these."""
    import _posixsubprocess

    def never(*_: object, **__: object) -> NoReturn:
        threading.Event().wait()
        raise AssertionError("unreachable")

    _posixsubprocess.fork_exec = never  # type: ignore[assignment]  # multiprocessing's spawn
    subprocess._fork_exec = never  # type: ignore[attr-defined]  # subprocess's own name for it
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, never)


def _take_stderr() -> int:
    """A private copy of stderr, for the one line; stderr itself then leads nowhere, so that this process's other
    threads (a progress bar, a thread's exception) write nothing below it. Flushed first: what Python holds for
    the terminal was written before the stop."""
    # Past Python's buffers: this may run inside a signal handler that interrupted a write to them.
    with contextlib.suppress(RuntimeError, ValueError, OSError):
        sys.stdout.flush()
        sys.stderr.flush()
    try:
        terminal = os.dup(2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    except OSError:
        return 2
    # A thread caught inside its write to the old stderr finishes that write; a moment lets it land above the line.
    time.sleep(0.05)
    return terminal


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


def _freeze_descendants(rounds: int = 10, apart: int | None = None) -> list[int]:
    """Stop every process this one started, and theirs (not `apart` or its own), listing them again until no new
    one appears, and return once each is stopped: a process that is sent SIGSTOP in the middle of writing a line
    finishes writing it first. This process's other threads (a Dask nanny's) keep running and may have started a
    worker while the list was being taken."""
    frozen: list[int] = []
    quiet = 0
    for _ in range(rounds):
        new = [pid for pid in _descendants(os.getpid(), apart=apart) if pid not in frozen]
        _send(new, signal.SIGSTOP)
        frozen.extend(new)
        quiet = 0 if new else quiet + 1
        if quiet == 2:  # twice, a moment apart: a thread may have been starting one as new starts were forbidden
            break
        time.sleep(0.002)
    _wait_stopped(frozen)
    return frozen


def _wait_stopped(pids: list[int], timeout: float = 1.0) -> None:
    """Until each of `pids` is stopped or gone (one in uninterruptible sleep may take long: it is given `timeout`)."""
    deadline = time.monotonic() + timeout
    waiting = list(pids)
    while waiting and time.monotonic() < deadline:
        waiting = [pid for pid in waiting if _state(pid) not in STOPPED_OR_GONE]
        if waiting:
            time.sleep(0.001)


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "X"
    return stat[stat.rindex(")") + 2]


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
