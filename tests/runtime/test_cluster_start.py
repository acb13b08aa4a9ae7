"""A local cluster whose worker is killed as it starts is started again, not failed (`runtime.cluster_start`)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from runtime import cluster_start, runners


def _worker_processes() -> set[int]:
    """This process's children that are multiprocessing's spawned workers (not a server a fixture started)."""
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit():
                continue
            stat = (proc / "stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == os.getpid():
                if b"spawn_main" in (proc / "cmdline").read_bytes():
                    found.add(int(proc.name))
        except OSError:
            continue
    return found


def test_a_worker_killed_as_the_cluster_starts_costs_a_start_not_the_run(caplog: pytest.LogCaptureFixture) -> None:
    before = _worker_processes()
    killed: list[int] = []

    def kill_the_first_worker() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            new = _worker_processes() - before
            if new:
                time.sleep(0.3)  # it is importing, far from reporting to its nanny
                pid = min(new)
                os.kill(pid, signal.SIGTERM)
                killed.append(pid)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_the_first_worker, daemon=True)
    killer.start()
    path, kwargs = runners.cluster_spec(1, gpus=False)
    assert path == "runtime.cluster_start.local_processes"
    with caplog.at_level(logging.WARNING, logger=cluster_start.__name__):
        cluster = cluster_start.local_processes(**kwargs)
    try:
        killer.join(timeout=5)
        assert killed, "no worker was killed"
        assert "a worker died as the cluster started" in caplog.text  # the kill landed in the start
        assert len(cluster.scheduler_info["workers"]) == 1
    finally:
        cluster.close()


def test_only_a_worker_that_did_not_start_is_tried_again() -> None:
    calls: list[int] = []

    def failing(error: Exception) -> object:
        calls.append(1)
        raise error

    nanny = RuntimeError("Cluster failed to start: boom")
    nanny.__cause__ = RuntimeError("Nanny failed to start.")
    with pytest.raises(RuntimeError, match="Cluster failed to start"):
        cluster_start.started(lambda: failing(nanny))
    assert len(calls) == cluster_start.STARTS
    calls.clear()
    with pytest.raises(RuntimeError, match="port in use"):
        cluster_start.started(lambda: failing(RuntimeError("port in use")))
    with pytest.raises(ValueError):
        cluster_start.started(lambda: failing(ValueError("bad option")))
    assert len(calls) == 2  # once each: nothing a second start would change
    flaky = iter([RuntimeError("Nanny failed to start."), None])

    def once_failing() -> str:
        error = next(flaky)
        if error is not None:
            raise error
        return "cluster"

    assert cluster_start.started(once_failing) == "cluster"
