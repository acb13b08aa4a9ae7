"""What a stop kills: every process the command started, also one started while the list was being taken, and not
the helper that outlives it or Python's resource tracker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from entrypoints import stopping


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        process.kill()
        process.wait()


def _sleeper(started: list[subprocess.Popen[bytes]]) -> int:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started.append(process)
    return process.pid


def test_a_process_started_while_the_list_is_taken_is_frozen_too(
    monkeypatch: pytest.MonkeyPatch, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    first = _sleeper(sleepers)
    late: list[int] = []
    listed = stopping._descendants

    def listing_that_starts_one(root: int, apart: int | None = None) -> list[int]:
        # Only this test's own: the suite's worker may have started servers of its own, not to be stopped here.
        found = [pid for pid in listed(root, apart) if pid in {p.pid for p in sleepers}]
        if not late:  # a nanny's thread starts a worker just after the first list
            late.append(_sleeper(sleepers))
        return found

    monkeypatch.setattr(stopping, "_descendants", listing_that_starts_one)
    frozen = stopping._freeze_descendants()
    try:
        assert first in frozen and late[0] in frozen
        for pid in (first, late[0]):
            deadline = time.monotonic() + 5
            while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
                assert time.monotonic() < deadline, f"{pid} was not stopped"
                time.sleep(0.01)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)


def test_a_process_whose_command_line_cannot_be_read_is_still_listed(
    monkeypatch: pytest.MonkeyPatch, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    pid = _sleeper(sleepers)
    read_bytes = Path.read_bytes

    def failing_cmdline(path: Path) -> bytes:
        if path.name == "cmdline":
            raise OSError("the process's memory is busy")
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", failing_cmdline)
    assert pid in stopping._descendants(os.getpid())


def test_the_helper_and_its_own_are_kept_apart(sleepers: list[subprocess.Popen[bytes]]) -> None:
    helper = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"]
    )
    sleepers.append(helper)
    other = _sleeper(sleepers)
    deadline = time.monotonic() + 10
    while len(stopping._descendants(helper.pid)) < 1:  # its own child has started
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = stopping._descendants(helper.pid)[0]
    try:
        found = stopping._descendants(os.getpid(), apart=helper.pid)
        assert other in found and helper.pid not in found and grandchild not in found
        assert {helper.pid, grandchild} <= set(stopping._descendants(os.getpid()))
    finally:
        os.kill(grandchild, signal.SIGKILL)


def test_python_s_resource_tracker_is_left_out(sleepers: list[subprocess.Popen[bytes]]) -> None:
    tracker_like = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "multiprocessing.resource_tracker"]
    )
    sleepers.append(tracker_like)
    deadline = time.monotonic() + 10
    while b"resource_tracker" not in Path(f"/proc/{tracker_like.pid}/cmdline").read_bytes():  # past its exec
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert tracker_like.pid not in stopping._descendants(os.getpid())


CHATTY = "import sys\nwhile True: sys.stderr.write('child says something\\n'); sys.stderr.flush()"
COMMAND = f"""
import signal, subprocess, sys, threading, time
from entrypoints import stopping

CHATTY = {CHATTY!r}
for _ in range(2):
    subprocess.Popen([sys.executable, "-c", CHATTY])

def chatter():  # a progress bar, a Dask scheduler's log
    while True:
        sys.stderr.write("thread says something\\n")

def restarter():  # a Dask nanny restarting its worker the moment it dies
    while True:
        subprocess.Popen([sys.executable, "-c", CHATTY])
        time.sleep(0.002)

for target in (chatter, restarter):
    threading.Thread(target=target, daemon=True).start()
time.sleep(0.5)
stopping.stop(signal.SIGTERM)
"""


@pytest.mark.parametrize("attempt", range(3))
def test_the_one_line_is_the_last_and_nothing_the_command_started_outlives_it(attempt: int) -> None:
    """Its threads, its children and a child one of its threads starts during the stop all write to stderr."""
    marker = f"K6VSR_TEST_CHATTY={os.getpid()}-{attempt}-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), marker.split("=")[0]: marker}
    done = subprocess.run([sys.executable, "-c", COMMAND], env=env, capture_output=True, timeout=60, check=False)
    stderr = done.stderr.decode()
    try:
        assert done.returncode == 143
        assert stderr.splitlines()[-1] == f"k6vsr: {stopping.MESSAGE}", stderr[-500:]
        assert _processes_with(marker) == [], "a process the command started outlived it"
    finally:
        for pid in _processes_with(marker):
            os.kill(pid, signal.SIGKILL)


def _processes_with(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes().split(b"\0"):
                if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(proc.name))
        except OSError:
            continue
    return found
