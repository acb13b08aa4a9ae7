"""The runtime's state folders: where they are (never in the checkout) and the one launcher of detached services."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from runtime.prefect_server import server_home
from runtime.state_folder import LaunchFailed, StateFolder
from runtime.warm_workers import workers_home
from storage.processes import alive, process_start


def test_state_lives_apart_from_the_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkout = tmp_path / "checkout"
    monkeypatch.setenv("K6VSR_HOME", str(checkout))  # the deployments' working folder: never state
    for name in ("K6VSR_STATE_HOME", "XDG_STATE_HOME", "K6VSR_SERVER_HOME", "K6VSR_WORKERS_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert server_home() == tmp_path / "user/.local/state/k6vsr/prefect-server"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert server_home() == tmp_path / "xdg/k6vsr/prefect-server"
    monkeypatch.setenv("K6VSR_STATE_HOME", str(tmp_path / "state"))
    assert workers_home() == tmp_path / "state/workers"
    monkeypatch.setenv("K6VSR_SERVER_HOME", str(tmp_path / "server"))
    assert server_home() == tmp_path / "server"


def _wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_a_launched_service_runs_in_its_own_session_recorded_and_nobodys_child(tmp_path: Path) -> None:
    folder = StateFolder(tmp_path / "svc", "svc")
    service = "import time; print('up', flush=True); time.sleep(60)"
    folder.launch([sys.executable, "-c", service], dict(os.environ), {"port": 4321, "started_at": "now"})
    record = json.loads(folder.record_path.read_text())
    pid = record["pid"]
    try:
        assert record["port"] == 4321 and record["started_at"] == "now"
        assert record["process_start"] == process_start(pid) and alive(pid, record["process_start"])
        assert os.getsid(pid) == pid  # its own session: a terminal's Ctrl-C or a killed command never reaches it
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # not this process's child: never its zombie
        assert _wait_for(lambda: "up" in folder.log_tail())
        assert not list(folder.path.glob("*.partial"))
    finally:
        os.killpg(pid, signal.SIGKILL)


def test_the_launcher_keeps_the_record_a_service_already_wrote(tmp_path: Path) -> None:
    folder = StateFolder(tmp_path, "svc")
    folder.make()
    folder.record_path.write_text('{"pid": 1, "address": "tcp://here"}')
    folder.launch([sys.executable, "-c", "pass"], dict(os.environ), {"address": None})
    assert json.loads(folder.record_path.read_text()) == {"pid": 1, "address": "tcp://here"}


def test_a_service_that_cannot_start_says_why(tmp_path: Path) -> None:
    folder = StateFolder(tmp_path, "svc")
    with pytest.raises(LaunchFailed, match="No such file"):
        folder.launch([str(tmp_path / "no-such-program")], dict(os.environ), {})
    assert not folder.record_path.exists()


def test_a_launch_that_leaves_no_record_it_can_read_says_so(tmp_path: Path) -> None:
    from pydantic import BaseModel

    class Record(BaseModel):
        pid: int
        address: str  # what the service itself would have written, and this one does not

    folder = StateFolder(tmp_path, "svc")
    with pytest.raises(LaunchFailed, match="no record in"):
        folder.launch_recorded([sys.executable, "-c", "pass"], dict(os.environ), {}, Record)
    fresh = StateFolder(tmp_path / "fresh", "svc")
    record = fresh.launch_recorded([sys.executable, "-c", "pass"], dict(os.environ), {"address": "here"}, Record)
    assert record.address == "here"
