"""Child processes for tests: a hung child fails its test with every thread's stack instead of hanging the suite.

The child runs in a session of its own with Python's fault handler on. Past the timeout it gets SIGABRT, which makes
the fault handler print each thread's traceback to stderr; then its whole process group is killed (a grandchild
holding the output pipes would otherwise keep `communicate` waiting) and the test fails with that stderr.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

# Far above any child's normal time here (the slowest takes about two minutes on two busy cores).
DEFAULT_TIMEOUT_S = 480.0


def run(
    argv: Sequence[str | Path],
    *,
    env: dict[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    cwd: str | Path | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(argv, capture_output=True, text=True)` that fails the test, with stacks, if it hangs."""
    process = start(argv, env=env, cwd=cwd, stdin=input is not None)
    done, hung = finish(process, timeout, input)
    if hung:
        pytest.fail(f"{' '.join(map(str, argv))[:300]} hung for {timeout:g} s; its threads:\n{done.stderr}")
    return done


def start(
    argv: Sequence[str | Path], *, env: dict[str, str] | None = None, cwd: str | Path | None = None, stdin: bool = False
) -> subprocess.Popen[str]:
    """A child with piped output, in a session of its own, that prints its stacks on SIGABRT."""
    return subprocess.Popen(
        [str(arg) for arg in argv],
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"},
        cwd=cwd,
        start_new_session=True,
    )


def finish(
    process: subprocess.Popen[str], timeout: float, input: str | None = None
) -> tuple[subprocess.CompletedProcess[str], bool]:
    """Its result, and whether it ran past `timeout`: then its whole process group is gone, its return code is -9
    and its stderr ends with every thread's stack."""
    try:
        out, err = process.communicate(input, timeout=timeout)
        return subprocess.CompletedProcess(process.args, process.returncode, out, err), False
    except subprocess.TimeoutExpired:
        _signal_group(process.pid, signal.SIGABRT)
        try:
            out, err = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            out, err = process.communicate()
        _signal_group(process.pid, signal.SIGKILL)
        return subprocess.CompletedProcess(process.args, -9, out or "", (err or "")[-12000:]), True


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
