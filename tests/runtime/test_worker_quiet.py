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


def test_a_lost_heartbeat_is_dropped_and_other_errors_are_kept(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("distributed.worker")
    before = list(logger.filters)
    try:
        worker_quiet.dask_setup(worker=None)
        with caplog.at_level(logging.ERROR, logger="distributed.worker"):
            try:
                raise ConnectionResetError(104, "Connection reset by peer")
            except ConnectionResetError:
                logger.exception("Failed to communicate with scheduler during heartbeat.")
            logger.error("Compute Failed")
        assert [r.getMessage() for r in caplog.records] == ["Compute Failed"]
    finally:
        logger.filters[:] = before


def test_nothing_is_said_once_the_parent_is_gone(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that a nanny restarted after the command's kill list was taken logs its broken scheduler connection."""
    logger = logging.getLogger("distributed.worker")
    before = list(logger.filters)
    alive = [True]
    monkeypatch.setattr(worker_quiet, "parent_alive", lambda: alive[0])
    try:
        worker_quiet.dask_setup(worker=None)
        with caplog.at_level(logging.INFO, logger="distributed.worker"):
            logger.info("Starting Worker plugin k6vsr")
            alive[0] = False
            logger.info("Stopping worker at tcp://127.0.0.1:41327. Reason: worker-handle-scheduler-connection-broken")
        assert [r.getMessage() for r in caplog.records] == ["Starting Worker plugin k6vsr"]
    finally:
        logger.filters[:] = before


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
