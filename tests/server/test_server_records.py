"""The HTTP API's job records as typed `JobRecord`s: a record written as the server wrote it before (a plain dict, as
JSON) loads, is answered as before, and is written back byte for byte; an update is validated."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import procs
import pytest
from pydantic import ValidationError

from entrypoints.server.auth import Caller
from entrypoints.server.fields import api_params
from entrypoints.server.job_records import JobRecord, JobStore
from entrypoints.server.routes import job_view
from storage.records import atomic_write_json

OWNER = "key_0123456789abcdef"
REQUEST = {"scale": 2.0, "seed": 7, "codec": "libx264", "max_frames": None}

# Records as the server wrote them while a job record was a dict: at submit, once started, completed and failed.
QUEUED = {
    "id": "video_queued_000000000000",
    "object": "video",
    "model": "k6vsr-model",
    "owner": OWNER,
    "status": "queued",
    "progress": 0,
    "created_at": 1_790_000_000,
    "created_ns": 1_790_000_000_123_456_789,
    "started_at": None,
    "completed_at": None,
    "error": None,
    "run_key": "run0",
    "request": REQUEST,
    "latent_fps": None,
    "source": {"type": "path", "video_path": "clips/a.mp4"},
    "output": {"width": 512, "height": 288, "frames": 9, "fps": 24, "has_audio": True, "bytes": None},
    "tiles": {"total": 12, "computed": None, "reused": None},
}
COMPLETED = {
    **QUEUED,
    "id": "video_completed_000000000",
    "status": "completed",
    "progress": 100,
    "started_at": 1_790_000_005,
    "completed_at": 1_790_000_060,
    "source": {"type": "upload"},
    "output": {"width": 512, "height": 288, "frames": 9, "fps": 24, "has_audio": False, "bytes": 40_961},
    "tiles": {"total": 12, "computed": 5, "reused": 7},
    "tiles_found": 7,
    "quality": {"frames": 9, "joins": 0, "findings": [], "source_psnr_db": 41.5},
    "disk_bytes": 900_000,
}
FAILED = {
    **QUEUED,
    "id": "video_failed_0000000000000",
    "owner": None,
    "status": "failed",
    "started_at": 1_790_000_005,
    "completed_at": 1_790_000_006,
    "error": {"message": "the clip: no video stream", "type": "invalid_request_error", "code": "invalid_video"},
    "latent_fps": "24",
    "source": {"type": "latent"},
    "tiles_found": 0,
}
OLD_RECORDS = (QUEUED, COMPLETED, FAILED)


def write_old(store: JobStore, record: dict) -> bytes:
    """Write `record` as the server wrote a dict record, and return the file's bytes."""
    atomic_write_json(store.record_path(record["id"]), record)
    return store.record_path(record["id"]).read_bytes()


def test_records_in_the_old_dict_form_load_and_are_written_back_the_same(tmp_path: Path) -> None:
    written = {record["id"]: write_old(JobStore(tmp_path, 1 << 20), record) for record in OLD_RECORDS}
    store = JobStore(tmp_path, 1 << 20)  # indexed at start, from the files
    assert {entry.id: entry.status for entry in store.entries()} == {r["id"]: r["status"] for r in OLD_RECORDS}
    completed = store.get(COMPLETED["id"])
    assert completed is not None and completed.tiles.reused == 7 and completed.disk_bytes == 900_000
    assert completed.output.bytes == 40_961 and completed.quality == COMPLETED["quality"]
    queued = store.get(QUEUED["id"])
    assert queued is not None and queued.source.video_path == "clips/a.mp4" and queued.tiles_found is None
    failed = store.get(FAILED["id"])
    assert failed is not None and failed.error is not None and failed.error.code == "invalid_video"
    assert failed.owner is None and failed.latent_fps == "24"
    for record in OLD_RECORDS:
        job = store.get(record["id"])
        assert job is not None and job.to_json() == record
        store.put(job)
        assert store.record_path(record["id"]).read_bytes() == written[record["id"]]


def test_an_old_record_is_answered_as_before(tmp_path: Path) -> None:
    store = JobStore(tmp_path, 1 << 20)
    write_old(store, COMPLETED)
    write_old(store, QUEUED)
    job = store.get(COMPLETED["id"])
    assert job is not None
    assert job_view(job, Caller(owner=OWNER), tmp_path, retention_s=3600.0) == {
        "id": COMPLETED["id"],
        "object": "video",
        "model": "k6vsr-model",
        "status": "completed",
        "progress": 100,
        "created_at": 1_790_000_000,
        "started_at": 1_790_000_005,
        "completed_at": 1_790_000_060,
        "expires_at": 1_790_003_660,
        "error": None,
        "run_key": "run0",
        "params": api_params(REQUEST),
        "size": "512x288",
        "seconds": "0.375",
        "output": COMPLETED["output"],
        "tiles": COMPLETED["tiles"],
        "quality": COMPLETED["quality"],
        "source": {"type": "upload"},
    }
    queued = store.get(QUEUED["id"])
    assert queued is not None
    view = job_view(queued, Caller(owner=OWNER), tmp_path, retention_s=3600.0)
    assert view["source"] == QUEUED["source"] and view["expires_at"] is None and view["tiles"] == QUEUED["tiles"]
    # Another key (an admin) sees the job, never the owner's path.
    assert job_view(queued, Caller(owner="key_other", admin=True), tmp_path, 3600.0)["source"] == {"type": "path"}
    failed = JobRecord.model_validate(FAILED)
    assert job_view(failed, Caller(owner=None), tmp_path, 3600.0)["error"] == FAILED["error"]


def test_an_update_is_validated_and_a_bad_one_changes_nothing(tmp_path: Path) -> None:
    store = JobStore(tmp_path, 1 << 20)
    before = write_old(store, QUEUED)
    with pytest.raises(TypeError, match="no field statu"):
        store.update(QUEUED["id"], statu="cancelled")
    with pytest.raises(ValidationError):
        store.update(QUEUED["id"], status="paused")
    assert store.record_path(QUEUED["id"]).read_bytes() == before
    started = store.update(QUEUED["id"], status="in_progress", started_at=1_790_000_001, tiles_found=3)
    assert started is not None and started.status == "in_progress" and started.tiles_found == 3
    assert store.get(QUEUED["id"]) == started
    assert [entry.status for entry in store.entries()] == ["in_progress"]
    # Only when the status is one of `only_if`: the job as it is is returned, unchanged.
    assert store.update(QUEUED["id"], only_if=("queued",), status="cancelled") == started


def test_a_file_that_is_no_job_record_is_skipped(tmp_path: Path) -> None:
    store = JobStore(tmp_path, 1 << 20)
    write_old(store, QUEUED)
    missing_output = {key: value for key, value in COMPLETED.items() if key != "output"}
    write_old(store, missing_output)
    store.record_path("video_torn_00000000000000").write_text('{"id": "video_torn_000')
    reloaded = JobStore(tmp_path, 1 << 20)
    assert [entry.id for entry in reloaded.entries()] == [QUEUED["id"]]
    assert reloaded.get(COMPLETED["id"]) is None and reloaded.get("video_torn_00000000000000") is None


def test_the_job_process_imports_no_library_before_it_is_bound_to_its_parent() -> None:
    """`entrypoints.server.child` takes only the standard library at import (its error messages from
    `entrypoints.server.messages`), so it arms its death signal at once; the pipeline, pydantic and all, comes later."""
    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys\nimport entrypoints.server.child\n"
        "print(sorted(name for name in ('pydantic', 'fastapi', 'prefect', 'storage') if name in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = procs.run([sys.executable, "-c", code], env=env, cwd=root, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
