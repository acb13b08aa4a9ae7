"""The local cluster's workers say nothing of a heartbeat their scheduler (the stopped command) did not answer, and
everything else as before."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime import runners, worker_quiet

ROOT = Path(__file__).resolve().parents[2]


def test_the_local_cluster_s_workers_load_the_preload() -> None:
    _, kwargs = runners.cluster_spec(2, gpus=False)
    assert kwargs["preload"] == ["runtime.worker_quiet", "tasks.worker_preload"]


def test_gpu_and_warm_workers_load_it_before_the_model() -> None:
    """`--gpus` and the warm workers build their workers alike (`make_cluster`)."""
    from runtime import warm_workers

    for devices in ([], ["0", "1"]):
        options = warm_workers.worker_options(devices, 1, 2)
        assert options["preload"] == ["runtime.worker_quiet", "tasks.worker_preload"]
        assert warm_workers.cpu_lane_options(2, 2)["preload"] == ["runtime.worker_quiet", "tasks.worker_preload"]


class _Lines(logging.Handler):
    """A terminal's handler on the `distributed` logger, as a worker process has one."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def terminal() -> Iterator[_Lines]:
    logger = logging.getLogger("distributed")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    before = {other: list(other.filters) for other in logging.getLogger().handlers}  # dask_setup filters these too
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        for other, filters in before.items():
            other.filters[:] = filters


def test_a_lost_heartbeat_is_dropped_and_other_errors_are_kept(terminal: _Lines) -> None:
    logger = logging.getLogger("distributed.worker")
    worker_quiet.dask_setup(worker=None)
    try:
        raise ConnectionResetError(104, "Connection reset by peer")
    except ConnectionResetError:
        logger.exception("Failed to communicate with scheduler during heartbeat.")
    logger.error("Compute Failed")
    assert terminal.lines == ["Compute Failed"]


def test_nothing_is_said_once_the_parent_is_gone(terminal: _Lines, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that outlives its command by a moment logs its broken scheduler connection, through any of the
    worker's loggers (`distributed.core`'s closed stream was seen below the command's last line in CI)."""
    alive = [True]
    monkeypatch.setattr(worker_quiet, "parent_alive", lambda: alive[0])
    worker_quiet.dask_setup(worker=None)
    logging.getLogger("distributed.worker").info("Starting Worker plugin k6vsr")
    alive[0] = False
    logging.getLogger("distributed.worker").info("Stopping worker at tcp://127.0.0.1:41327. Reason: broken")
    logging.getLogger("distributed.core").info("Connection to tcp://127.0.0.1:41151 has been closed.")
    assert terminal.lines == ["Starting Worker plugin k6vsr"]


def test_a_worker_in_the_command_s_own_process_watches_nothing() -> None:
    assert worker_quiet.parent_alive()
    assert worker_quiet.exit_with_parent() is None


LAUNCHER = """
import multiprocessing, os, sys, time

def worker():
    from runtime import worker_quiet
    worker_quiet.dask_setup(worker=None)
    print(os.getpid(), flush=True)
    time.sleep(600)

if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=worker)
    child.start()
    child.join(timeout=600)  # the test kills this process with SIGKILL while its child sleeps
"""


def test_a_worker_ends_when_its_parent_is_killed(tmp_path: Path) -> None:
    """As a Dask nanny starts workers (spawn); the parent is killed with SIGKILL, which it cannot catch."""
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert launcher.stdout is not None
        child = int(launcher.stdout.readline())
        assert _running(child)
        launcher.kill()
        launcher.wait()
        for _ in range(600):  # gone at once in practice; a loaded machine may take its time
            if not _running(child):
                break
            time.sleep(0.1)
        assert not _running(child), "the worker outlived its parent"
    finally:
        launcher.kill()
        with contextlib.suppress(ProcessLookupError, NameError):
            os.kill(child, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan is reaped by init, which may take a moment)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
