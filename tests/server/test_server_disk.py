"""The HTTP server on a full disk: the request or the job that hit it fails clearly (`disk_full`: 507 for a request,
a failed job), nothing it wrote is left, the job worker lives on, and `/health` says the disk is full until a write
succeeds again.

The full disk is injected: `OSError(ENOSPC)` from the job store's record writes, from an upload's writes, and (through
the fault harness) from a job's own tile store in its child process.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from fault_harness import child_environment, fired
from http_harness import error_of

from entrypoints.server import job_records as records
from entrypoints.server.app import Limits, ServerConfig, create_app
from entrypoints.server.child import _error_of
from entrypoints.server.disk import is_disk_full
from entrypoints.server.job_records import InputFile, JobStore
from entrypoints.server.job_runner import JobRunner
from k6vsr_core.media.sample import make_sample_clip
from service.runs import ModelSpec

ROOT = Path(__file__).resolve().parents[2]
KEY = "key-a-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = Limits(
    max_upload_bytes=1 << 20,
    max_fields=8,
    max_fields_bytes=8 << 10,
    max_queued=4,
    input_quota_bytes=8 << 20,
    max_output_pixels=2048 * 10**6,
    retention_s=3600.0,
)


def no_space(*_: Any, **__: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class FullFile:
    """A file on a disk with `room` bytes left: the write that passes it raises ENOSPC."""

    def __init__(self, file: Any, room: int) -> None:
        self.file, self.room = file, room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            no_space()
        self.room -= len(data)
        return self.file.write(data)

    def close(self) -> None:
        self.file.close()


@pytest.fixture
def uploads_fill_the_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every upload's file finds 1,000 bytes of room."""
    opened = InputFile.__init__

    def full_input(self: InputFile, *args: Any, **kwargs: Any) -> None:
        opened(self, *args, **kwargs)
        self._file = FullFile(self._file, 1000)  # type: ignore[assignment]

    monkeypatch.setattr(InputFile, "__init__", full_input)


def app_for(store: Path, bundle: Path):
    config = ServerConfig(store_root=store, limits=LIMITS, api_keys=(KEY,))
    return create_app(config, ModelSpec(model=str(bundle), device="cpu"))


def upload(client: TestClient, clip: Path):
    files = {"video_reference": ("x.mp4", clip.read_bytes(), "video/mp4")}
    return client.post("/v1/videos", files=files, data={"sr_resolution_scale": "2"}, headers=AUTH)


def test_an_upload_on_a_full_disk_gets_507_and_leaves_nothing(
    uploads_fill_the_disk: None, tmp_path: Path, tiny_bundle_path: Path
) -> None:
    """The probe: an upload whose clip does not fit. 507 `disk_full` (not 500), with Retry-After and the connection
    closed; the partial file and its folder are gone, its quota given back; `/health` says the disk is full, until a
    record is written again."""
    clip = make_sample_clip(tmp_path / "clip.mp4", width=64, height=64, num_frames=1, audio=False)
    assert clip.stat().st_size > 1000
    store = tmp_path / "store"
    app = app_for(store, tiny_bundle_path)
    client = TestClient(app)
    answer = upload(client, clip)
    error = error_of(answer, 507, [str(tmp_path)])
    assert error["code"] == "disk_full" and "disk is full" in error["message"], error
    assert answer.headers["retry-after"] and answer.headers["connection"] == "close"
    assert list((store / "jobs").iterdir()) == []
    assert app.state.videos.store.quota.used == 0
    health = client.get("/health", headers=AUTH).json()
    assert health["status"] == "degraded" and health["disk"] == "full", health
    app.state.videos.store.flush_unsaved()  # the janitor's round: the probe write succeeds
    assert client.get("/health", headers=AUTH).json()["disk"] == "ok"


def test_a_record_that_finds_the_disk_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new job's record that cannot be written fails its request; a known job's is kept in memory, read from
    there, and written by the next round once there is room."""
    store = JobStore(tmp_path, 1 << 20)
    job = records.JobRecord(
        id="video_abcdefghijklmnopqr",
        model="m",
        status="queued",
        created_at=0,
        run_key="r",
        request={},
        source=records.JobSource(type="upload"),
        output=records.JobOutput(width=1, height=1, frames=1, fps=1, has_audio=False, bytes=None),
        tiles=records.JobTiles(total=1, computed=None, reused=None),
    )
    store.put(job)
    monkeypatch.setattr(records, "_write_json", no_space)
    with pytest.raises(OSError) as raised:
        store.put(job.changed(id="video_bbcdefghijklmnopqr"))
    assert is_disk_full(raised.value) and store.disk.full
    assert store.get("video_bbcdefghijklmnopqr") is None
    store.update(job.id, status="failed")  # a worker recording how the job ended: no error
    assert store.get(job.id).status == "failed"  # type: ignore[union-attr]
    assert records.JobRecord.model_validate_json(store.record_path(job.id).read_bytes()).status == "queued"
    store.flush_unsaved()  # still full: nothing changes, nothing raises
    assert store.disk.full
    monkeypatch.undo()
    store.flush_unsaved()
    assert not store.disk.full
    assert records.JobRecord.model_validate_json(store.record_path(job.id).read_bytes()).status == "failed"


def test_the_workers_own_failure_record_never_takes_it_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's last resort, when a job's run raised and its failure record cannot be written either (a disk
    that fails otherwise than full): logged, never raised, so the worker takes the next job."""
    store = JobStore(tmp_path, 1 << 20)
    runner = JobRunner(store, ModelSpec(model="unused"), 1, replace(LIMITS, retention_s=60))
    monkeypatch.setattr(store, "update", lambda *_, **__: _raise_eio())
    runner.slots[0]._fail("video_abcdefghijklmnopqr", OSError(errno.ENOSPC, "No space left on device"))
    assert store.disk.full


def _raise_eio() -> None:
    raise OSError(errno.EIO, os.strerror(errno.EIO))


def test_a_jobs_disk_full_error_is_the_servers_not_the_clients() -> None:
    error = _error_of(OSError(errno.ENOSPC, "No space left on device", "/srv/k6vsr/store/runs/x/tile.zarr"))
    assert error["code"] == "disk_full" and error["type"] == "server_error" and "/srv" not in error["message"]
    wrapped = RuntimeError("tile store failed")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert _error_of(wrapped)["code"] == "disk_full"


@pytest.fixture
def running_app(
    tmp_path: Path, tiny_bundle_path: Path, prefect_server: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[TestClient, Any, Path]]:
    """The app with its job runner, its job processes hitting ENOSPC as they publish their first output, on each
    of its three tries (a full disk stays full)."""
    state = tmp_path / "faults"
    for name, value in child_environment(["nospace@publish:times=3"], state).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.environ["PYTHONPATH"], str(ROOT)]))
    app = app_for(tmp_path / "store", tiny_bundle_path)
    with TestClient(app) as client:
        yield client, app, state


def wait_for(client: TestClient, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        job = client.get(f"/v1/videos/{job_id}", headers=AUTH).json()
        if job["status"] in ("completed", "failed", "cancelled"):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still {job['status']}")


def test_a_job_that_fills_the_disk_fails_and_the_worker_runs_the_next(
    running_app: tuple[TestClient, Any, Path], tmp_path: Path
) -> None:
    """The probe: the disk fills while a job runs, for its child's tile store and the server's records alike. The
    job fails with `disk_full`, its failure answered from memory; a new submission gets 507; `/health` says the
    disk is full. Once there is room the failure is on disk, `/health` is ok, and the same worker runs the next
    job to completion."""
    client, app, state = running_app
    clip = make_sample_clip(tmp_path / "clip.mp4", width=64, height=64, num_frames=1, audio=False)
    first = upload(client, clip).json()["id"]
    with pytest.MonkeyPatch.context() as full:
        full.setattr(records, "_write_json", no_space)  # the server's records too, from here on
        failed = wait_for(client, first)
        assert fired(state), "the job's child never reached its publish"
        assert failed["status"] == "failed" and failed["error"]["code"] == "disk_full", failed
        assert str(tmp_path) not in str(failed)
        health = client.get("/health", headers=AUTH).json()
        assert health["status"] == "degraded" and health["disk"] == "full", health
        assert error_of(upload(client, clip), 507)["code"] == "disk_full"
        assert [p.name for p in (tmp_path / "store" / "jobs").iterdir() if p.is_dir()] == []
    # Room again: the janitor writes the failure within its next rounds.
    deadline = time.monotonic() + 30
    while client.get("/health", headers=AUTH).json()["disk"] != "ok":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    store = app.state.videos.store
    assert records.JobRecord.model_validate_json(store.record_path(first).read_bytes()).status == "failed"
    second = upload(client, clip).json()["id"]
    assert wait_for(client, second)["status"] == "completed"
    health = client.get("/health", headers=AUTH).json()
    assert health["status"] == "ok" and health["workers"] == {"alive": 1, "total": 1}, health
