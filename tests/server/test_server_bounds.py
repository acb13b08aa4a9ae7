"""What a job costs the server, bounded: a job that cannot run is refused at submit, records and flow-run parameters
stay small, listing reads only what it lists, slow uploads are cut off and cannot starve another key, and finished
jobs keep a bounded disk.

The app runs in this process without its job runner (jobs are queued, never run): everything here is decided
before a job runs. The tests that need several connections at once serve it with uvicorn on loopback.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import av
import pytest
import uvicorn
from fastapi.testclient import TestClient
from http_harness import error_of, free_port

from entrypoints.server.api_errors import ApiError, error_response
from entrypoints.server.app import Limits, ServerConfig, create_app, key_owner
from entrypoints.server.child import _error_of, results_beside
from entrypoints.server.job_records import JobRecord, JobStore
from entrypoints.server.job_runner import JobRunner
from entrypoints.server.messages import MAX_MESSAGE_CHARS
from entrypoints.server.worker_slots import job_message, tile_counts
from k6vsr_core.errors import MediaError, ParameterError
from k6vsr_core.media.sample import make_sample_clip
from k6vsr_core.model.memory import MemoryBudgetError
from service.runs import ModelSpec

KEY_A, KEY_B = "key-a-0123456789abcdef", "key-b-0123456789abcdef"
LIMITS = Limits(
    max_upload_bytes=1 << 20,
    max_fields=8,
    max_fields_bytes=8 << 10,
    max_queued=4,
    input_quota_bytes=8 << 20,
    max_output_pixels=2048 * 10**6,  # the default of --max-output-mpx
    retention_s=3600.0,
)


def huge_declared_clip(path: Path, width: int = 6400, height: int = 6248, frames: int = 9) -> Path:
    """A ~120 KB MP4 of `frames` black frames of `width` x `height`."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast"}
        frame = av.VideoFrame(width, height, "yuv420p")
        for plane in frame.planes:
            plane.update(bytes(plane.buffer_size))
        for _ in range(frames):
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def app_for(store: Path, bundle: Path, limits: Limits = LIMITS, keys: tuple[str, ...] = (KEY_A, KEY_B)):
    config = ServerConfig(store_root=store, limits=limits, api_keys=keys)
    return create_app(config, ModelSpec(model=str(bundle), device="cpu"))


def upload(client: TestClient, clip: Path, key: str, **fields: str):
    files = {"video_reference": ("x.mp4", clip.read_bytes(), "video/mp4")}
    return client.post("/v1/videos", files=files, data=fields, headers={"Authorization": f"Bearer {key}"})


def test_serve_flags_set_the_limits(tmp_path: Path) -> None:
    from entrypoints.cli import build_parser
    from entrypoints.server.app import config_from

    defaults = config_from(build_parser().parse_args(["serve"]), tmp_path, "m").limits
    assert (defaults.max_tiles, defaults.max_windows, defaults.upload_timeout_s) == (2048, 512, 900)
    assert (defaults.uploads_per_key, defaults.finished_quota_bytes) == (4, 51200 << 20)
    flags = "--max-tiles 10 --max-windows 2 --upload-timeout-s 1.5 --max-uploads-per-key 1 --finished-quota-mb 3"
    limits = config_from(build_parser().parse_args(["serve", *flags.split()]), tmp_path, "m").limits
    assert (limits.max_tiles, limits.max_windows, limits.upload_timeout_s) == (10, 2, 1.5)
    assert (limits.uploads_per_key, limits.finished_quota_bytes) == (1, 3 << 20)
    with pytest.raises(ParameterError, match="--max-tiles"):
        config_from(build_parser().parse_args(["serve", "--max-tiles", "0"]), tmp_path, "m")
    assert (defaults.finished_per_key, defaults.memory_budget_bytes > 1 << 30) == (1000, True)
    connections = config_from(build_parser().parse_args(["serve"]), tmp_path, "m").connections
    assert (connections.max_connections, connections.header_timeout_s, connections.keep_alive_s) == (1000, 10, 5)
    assert (connections.send_timeout_s, connections.send_buffer_bytes) == (30, None)
    flags = "--max-connections 50 --header-timeout-s 2 --keep-alive-s 3 --max-finished-per-key 7 --memory-budget-mb 512"
    more = ["--send-timeout-s", "4", "--send-buffer-kb", "64"]
    config = config_from(build_parser().parse_args(["serve", *flags.split(), *more]), tmp_path, "m")
    assert (config.connections.max_connections, config.connections.header_timeout_s) == (50, 2)
    assert (config.connections.send_timeout_s, config.connections.send_buffer_bytes) == (4, 64 << 10)
    assert (config.connections.keep_alive_s, config.limits.finished_per_key) == (3, 7)
    assert config.limits.memory_budget_bytes == 512 << 20
    assert (defaults.min_upload_bytes_per_s, defaults.upload_rate_window_s) == (8 << 10, 30)
    flags = "--min-upload-kb-s 2 --upload-rate-window-s 5"
    limits = config_from(build_parser().parse_args(["serve", *flags.split()]), tmp_path, "m").limits
    assert (limits.min_upload_bytes_per_s, limits.upload_rate_window_s) == (2048, 5)
    with pytest.raises(ParameterError, match="--upload-rate-window-s"):
        config_from(build_parser().parse_args(["serve", "--upload-rate-window-s", "0"]), tmp_path, "m")


def test_connections_fit_the_open_file_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `ulimit -n 1024` (soft and hard) the connections are lowered so that the accept batches in flight and
    the files the server opens always have descriptors, each connection counted with the file it may hold open (an
    upload's or a download's); a soft limit below the hard one is raised instead."""
    import resource

    from entrypoints.server import serving
    from entrypoints.server.config import Connections

    raised: list[tuple[int, int]] = []

    def refuse(_: int, limits: tuple[int, int]) -> None:
        raised.append(limits)
        raise ValueError("not permitted")

    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 1024))
    monkeypatch.setattr(resource, "setrlimit", refuse)
    fitted = serving.fit_connections(Connections(max_connections=1000, header_timeout_s=2.0))
    assert fitted.max_connections == (1024 - serving.RESERVED_FDS) // 2 and fitted.header_timeout_s == 2.0
    assert raised == [(1024, 1024)]
    # Every connection a stalled download (its socket and the output it sends): the reserve is still there.
    assert fitted.max_connections * 2 + serving.RESERVED_FDS <= 1024
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 65536))
    monkeypatch.setattr(resource, "setrlimit", lambda _, limits: raised.append(limits))
    assert serving.fit_connections(Connections(max_connections=1000)).max_connections == 1000
    assert raised[-1] == (2 * 1000 + serving.RESERVED_FDS, 65536)


# ------------------------------------------------------------------------------------------- refused at submit


def test_small_upload_declared_huge_is_refused_at_submit(tmp_path: Path, tiny_bundle_path: Path) -> None:
    """The probe: 9 frames declared 6400x6248 (about 120 KB, under the output-pixel cap) plan tens of thousands of
    tiles; the job could never run, so it is refused at once, and leaves nothing behind."""
    clip = huge_declared_clip(tmp_path / "huge.mp4")
    assert clip.stat().st_size < LIMITS.max_upload_bytes
    store = tmp_path / "store"
    client = TestClient(app_for(store, tiny_bundle_path))
    error = error_of(upload(client, clip, KEY_A), 400, [str(tmp_path)])
    assert error["code"] == "too_many_tiles" and error["type"] == "invalid_request_error", error
    assert "--max-tiles" in error["message"] and len(error["message"]) <= MAX_MESSAGE_CHARS
    assert not list((store / "jobs").iterdir())

    # The window cap: 300 frames are 3 windows, refused under --max-windows 2.
    long_clip = make_sample_clip(tmp_path / "long.mp4", width=64, height=64, num_frames=300, audio=False)
    few_windows = TestClient(app_for(store, tiny_bundle_path, replace(LIMITS, max_windows=2)))
    error = error_of(upload(few_windows, long_clip, KEY_A, sr_resolution_scale="2"), 400)
    assert error["code"] == "too_many_windows" and "--max-windows" in error["message"], error


def test_a_relative_video_path_is_refused(
    tmp_path: Path, tiny_bundle_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resolved against the server's working folder it would name a file of the server's: refused, whatever is there."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    make_sample_clip(allowed / "clip.mp4", width=64, height=64, num_frames=1, audio=False)
    monkeypatch.chdir(allowed)
    config = ServerConfig(store_root=tmp_path / "store", limits=LIMITS, allow_paths=(allowed,))
    client = TestClient(create_app(config, ModelSpec(model=str(tiny_bundle_path), device="cpu")))
    for relative in ("clip.mp4", "./clip.mp4", "../allowed/clip.mp4"):
        error = error_of(client.post("/v1/videos", json={"video_path": relative}), 400, [str(tmp_path)])
        assert error["code"] == "path_not_absolute" and error["param"] == "video_path", error
    assert client.post("/v1/videos", json={"video_path": str(allowed / "clip.mp4")}).status_code == 200


def test_record_and_flow_parameters_hold_no_plan(tmp_path: Path, tiny_bundle_path: Path) -> None:
    """A job of hundreds of tiles: its record and the message its worker process is handed are a few hundred bytes
    each (a run key and the request), not its plan, which grows with the tiles."""
    clip = make_sample_clip(tmp_path / "big.mp4", width=512, height=512, num_frames=9, audio=False)
    store = tmp_path / "store"
    client = TestClient(app_for(store, tiny_bundle_path))
    response = upload(client, clip, KEY_A, sr_resolution_scale="4")
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["tiles"]["total"] > 100, job["tiles"]
    record = store / "jobs" / f"{job['id']}.json"
    assert record.stat().st_size < 2048, record.stat().st_size
    stored = json.loads(record.read_text())
    assert "prepared" not in stored and stored["run_key"] == job["run_key"]
    message = job_message(JobStore(store, 1 << 20), JobRecord.model_validate(stored))
    assert set(message) == {"id", "source", "output", "params", "store_root", "latent_fps"}
    assert len(json.dumps(message)) < 2048


def test_error_messages_are_short_and_typed() -> None:
    huge = "x " * 1_100_000  # a library's message of megabytes
    internal = _error_of(RuntimeError(huge))
    assert internal["type"] == "server_error" and len(internal["message"]) <= MAX_MESSAGE_CHARS
    user = _error_of(MediaError("the clip", "no video stream"))
    assert user == {"message": user["message"], "type": "invalid_request_error", "code": "invalid_video"}
    body = json.loads(error_response(ApiError(400, huge)).body)
    assert len(body["error"]["message"]) <= MAX_MESSAGE_CHARS


def test_a_failed_jobs_error_and_the_apis_answer_come_from_one_table() -> None:
    from entrypoints.server.api_errors import api_error
    from entrypoints.server.error_table import USER_ERROR_STATUS

    for kind, status, code in USER_ERROR_STATUS:
        err = kind("the clip", "no video stream") if issubclass(kind, MediaError) else kind("refused")
        answer = api_error(err)
        assert (answer.status, answer.code) == (status, code)
        assert _error_of(err) == {"message": str(err), "type": "invalid_request_error", "code": code}


def test_a_permanent_media_error_is_not_retried() -> None:
    """A stage task retries what may pass (an I/O error, a broken invariant), never the decoder's verdict on the same
    bytes or another error of the user's."""
    from tasks.stage_tasks import _retry_transient

    class Failed:
        def __init__(self, err: BaseException) -> None:
            self.err = err

        def result(self) -> None:
            raise self.err

    for permanent in (
        av.error.EOFError(541478725, "End of file"),
        MediaError("clip", "decoding failed"),
        ParameterError("seed=-1 is out of range"),
        MemoryBudgetError("8.0 GiB free; memory=16g needs about 12 GiB"),
    ):
        assert not _retry_transient(None, None, Failed(permanent)), permanent
    for transient in (
        OSError(5, "Input/output error"),
        RuntimeError("CUDA error: an illegal memory access"),
        ValueError("tile 3 was already blended"),
    ):
        assert _retry_transient(None, None, Failed(transient)), transient


def test_tile_counts_stay_honest_across_a_restart() -> None:
    """49 tiles, none stored when the job first started; the killed attempt computed 39, the resumed one the other
    10. The resumed attempt's own summary says 10 computed, 39 reused; the job says 49 computed."""
    resumed = {"tiles_total": 49, "tiles_computed": 10}
    assert tile_counts(resumed, found=0) == {"total": 49, "computed": 49, "reused": 0}
    # A job that found 30 tiles of an earlier job's run, and was never restarted: the summary is right as it is.
    assert tile_counts({"tiles_total": 49, "tiles_computed": 19}, found=30) == {
        "total": 49,
        "computed": 19,
        "reused": 30,
    }
    assert tile_counts({"tiles_total": 49, "tiles_computed": 0}, found=49)["reused"] == 49


def test_a_failed_jobs_pickled_exception_stays_in_its_folder(prefect_server: str, tmp_path: Path) -> None:
    """What Prefect persists of a failed flow run lands in the job's folder, which goes with the job."""
    from prefect import flow
    from prefect.settings import get_current_settings

    default = Path(get_current_settings().results.local_storage_path)
    before = set(default.iterdir()) if default.is_dir() else set()

    @flow(name="k6vsr-test-failing")
    def failing() -> None:
        raise RuntimeError("/srv/k6vsr/store/jobs/video_x/input: no video stream")

    job_dir = tmp_path / "jobs" / "video_abcdefghijklmnopq"
    with results_beside(str(job_dir / "output.mp4")):
        assert failing(return_state=True).is_failed()
    assert [path.is_file() for path in (job_dir / "prefect-results").iterdir()] == [True]
    assert (set(default.iterdir()) if default.is_dir() else set()) == before


# -------------------------------------------------------------------------------------------------- listing


def test_submit_and_cancel_rounds_keep_records_small_and_listing_flat(
    tmp_path: Path, tiny_bundle_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """30 rounds of submit-and-cancel by key B: every record stays small, and key A's list reads none of them (a
    list costs the jobs it lists), so its time does not grow with B's records."""
    clip = make_sample_clip(tmp_path / "clip.mp4", width=256, height=256, num_frames=9, audio=False)
    store = tmp_path / "store"
    client = TestClient(app_for(store, tiny_bundle_path))
    a, b = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}
    mine = upload(client, clip, KEY_A, seed="1").json()["id"]
    reads: list[str] = []
    get = JobStore.get
    monkeypatch.setattr(JobStore, "get", lambda self, job_id: reads.append(job_id) or get(self, job_id))
    latencies = []
    for round_ in range(30):
        posted = upload(client, clip, KEY_B, seed=str(100 + round_))
        assert posted.status_code == 200, posted.text
        assert client.delete(f"/v1/videos/{posted.json()['id']}", headers=b).json()["status"] == "cancelled"
        reads.clear()
        started = time.perf_counter()
        listed = client.get("/v1/videos", headers=a).json()["data"]
        latencies.append(time.perf_counter() - started)
        assert [job["id"] for job in listed] == [mine] and reads == [mine]
    sizes = [path.stat().st_size for path in (store / "jobs").glob("video_*.json")]
    assert len(sizes) == 31 and max(sizes) < 2048, sizes
    assert len(client.get("/v1/videos", headers=b).json()["data"]) == 30
    assert max(latencies[-5:]) < 10 * min(latencies[:5]) + 0.25, latencies


# ---------------------------------------------------------------------------------------- slow uploads, fairness


@contextmanager
def serving(app: Any) -> Iterator[int]:
    """`app` on a loopback port (uvicorn in a thread, no lifespan: jobs are queued, never run)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@pytest.fixture
def served(tmp_path: Path, tiny_bundle_path: Path) -> Iterator[int]:
    """The app with two keys, a 2 s body deadline and one upload a key at once."""
    limits = replace(LIMITS, upload_timeout_s=2.0, uploads_per_key=1)
    with serving(app_for(tmp_path / "store", tiny_bundle_path, limits)) as port:
        yield port


@pytest.fixture
def served_anonymous(tmp_path: Path, tiny_bundle_path: Path) -> Iterator[int]:
    """The app without keys, a 5 s body deadline and the default share of uploads."""
    limits = replace(LIMITS, upload_timeout_s=5.0)
    with serving(app_for(tmp_path / "store", tiny_bundle_path, limits, keys=())) as port:
        yield port


def stalled_upload(port: int, key: str | None) -> socket.socket:
    """A chunked multipart upload (with `key`, if any) that sends its head and a first chunk of the clip, then
    nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=15)
    authorization = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (
        "POST /v1/videos HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
        f"{authorization}Content-Type: multipart/form-data; boundary=b0undary\r\n\r\n"
    )
    part = b'--b0undary\r\nContent-Disposition: form-data; name="video_reference"; filename="x"\r\n\r\n' + b"\0" * 1000
    sock.sendall(head.encode() + b"%x\r\n" % len(part) + part + b"\r\n")
    return sock


def answer_of(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def test_stalled_uploads_of_one_key_neither_starve_another_nor_last(served: int, tmp_path: Path) -> None:
    """The probe: one key opens as many never-finishing uploads as there are admission slots. Past its share it
    gets 429 at once; the other key's upload is taken; the stalled one is cut off with 408 at its deadline."""
    import httpx

    clip = make_sample_clip(tmp_path / "clip.mp4", width=64, height=64, num_frames=1, audio=False)
    started = time.monotonic()
    stalled = [stalled_upload(served, KEY_A)]
    try:
        time.sleep(0.5)  # the first is admitted and reading
        stalled += [stalled_upload(served, KEY_A) for _ in range(LIMITS.max_queued - 1)]
        refused = [answer_of(sock) for sock in stalled[1:]]
        assert all(status == 429 and body["error"]["code"] == "too_many_uploads" for status, body in refused), refused

        with httpx.Client(base_url=f"http://127.0.0.1:{served}", timeout=15) as client:
            files = {"video_reference": ("x.mp4", clip.read_bytes(), "video/mp4")}
            other = client.post("/v1/videos", files=files, headers={"Authorization": f"Bearer {KEY_B}"})
            assert other.status_code == 200, other.text

            status, body = answer_of(stalled[0])
            assert status == 408 and body["error"]["code"] == "request_timeout", body
            assert time.monotonic() - started < 2.0 + 10
            again = client.post("/v1/videos", files=files, headers={"Authorization": f"Bearer {KEY_A}"})
            assert again.status_code == 200, again.text  # its slot and quota were given back
    finally:
        for sock in stalled:
            sock.close()


@pytest.fixture
def served_with_floor(tmp_path: Path, tiny_bundle_path: Path) -> Iterator[tuple[int, Path]]:
    """The app with two keys, a 30 s body deadline and a floor of 256 bytes a second over 0.5 s windows."""
    limits = replace(LIMITS, upload_timeout_s=30.0, min_upload_bytes_per_s=256.0, upload_rate_window_s=0.5)
    store = tmp_path / "store"
    with serving(app_for(store, tiny_bundle_path, limits)) as port:
        yield port, store


def paced_upload(port: int, key: str, body: bytes, piece: int, every_s: float) -> tuple[int, dict]:
    """A chunked multipart upload of `body` (a complete form) sent `piece` bytes at a time, one every `every_s`,
    until the server answers; the answer."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=15)
    head = (
        "POST /v1/videos HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: multipart/form-data; boundary=b0undary\r\n\r\n"
    )
    with sock:
        sock.sendall(head.encode())
        for start in range(0, len(body), piece):
            if select.select([sock], [], [], 0)[0]:
                break  # answered
            part = body[start : start + piece]
            sock.sendall(b"%x\r\n" % len(part) + part + b"\r\n")
            time.sleep(every_s)
        else:
            sock.sendall(b"0\r\n\r\n")
        return answer_of(sock)


def form_of(clip: Path) -> bytes:
    return (
        b'--b0undary\r\nContent-Disposition: form-data; name="video_reference"; filename="x"\r\n\r\n'
        + clip.read_bytes()
        + b"\r\n--b0undary--\r\n"
    )


@pytest.mark.timed
def test_a_stalled_or_trickling_upload_loses_its_slot_at_the_rate_floor(
    served_with_floor: tuple[int, Path], tmp_path: Path
) -> None:
    """The probe: a key's never-finishing uploads, which held their slots until the body deadline, are cut off with
    408 `upload_too_slow` once a window brings less than the floor, long before the deadline, and their partial
    files are removed: the key uploads again at once. A trickle below the floor is cut off too; an upload slower
    than a window but above the floor is taken."""
    port, store = served_with_floor
    clip = make_sample_clip(tmp_path / "clip.mp4", width=64, height=64, num_frames=1, audio=False)
    started = time.monotonic()
    stalled = [stalled_upload(port, KEY_A) for _ in range(2)]  # the key's share of the four slots
    try:
        answers = [answer_of(sock) for sock in stalled]
    finally:
        for sock in stalled:
            sock.close()
    assert all(status == 408 and body["error"]["code"] == "upload_too_slow" for status, body in answers), answers
    assert "--min-upload-kb-s" in answers[0][1]["error"]["message"]
    assert time.monotonic() - started < 5.0  # the 30 s deadline is far
    assert list((store / "jobs").iterdir()) == []  # no partial upload left
    status, body = paced_upload(port, KEY_A, form_of(clip), piece=10, every_s=0.2)  # 50 bytes a second
    assert status == 408 and body["error"]["code"] == "upload_too_slow", body
    # ~2 KB a second, over about a second: two windows, each above the floor.
    status, body = paced_upload(port, KEY_A, form_of(clip), piece=200, every_s=0.1)
    assert status == 200 and body["status"] == "queued", body
    assert time.monotonic() - started < 10.0


# -------------------------------------------------------------------------------------------- finished jobs


def finished_record(
    job_id: str, owner: str, status: str, run_key: str, created_ns: int, completed_at: int, disk_bytes: int
) -> JobRecord:
    return JobRecord.model_validate(
        {
            "id": job_id,
            "model": "m",
            "owner": owner,
            "status": status,
            "created_at": completed_at - 10,
            "created_ns": created_ns,
            "completed_at": completed_at,
            "run_key": run_key,
            "request": {},
            "source": {"type": "upload"},
            "output": {"width": 2, "height": 2, "frames": 1, "fps": 24, "has_audio": False, "bytes": None},
            "tiles": {"total": 1, "computed": None, "reused": None},
            "disk_bytes": disk_bytes,
        }
    )


def test_finished_jobs_keep_a_bounded_disk_oldest_deleted_first(tmp_path: Path) -> None:
    store = JobStore(tmp_path, 1 << 20)
    runner = JobRunner(store, ModelSpec(model="unused"), 1, replace(LIMITS, finished_quota_bytes=250))
    now = int(time.time())
    for index, (status, size) in enumerate([("completed", 100), ("failed", 0), ("completed", 100), ("completed", 100)]):
        job_id = f"video_{'abcdefghijklmnop'}{index}"
        store.put(finished_record(job_id, key_owner(KEY_A), status, f"run{index}", index, now - 100 + index, size))
    assert runner.expire() == ["video_abcdefghijklmnop0"]  # 300 bytes kept: the oldest completed goes
    assert [entry.id[-1] for entry in store.entries()] == ["1", "2", "3"]
    runner.finished_quota_bytes = 10
    assert runner.expire() == ["video_abcdefghijklmnop2"]  # the newest stays whatever its size
    assert JobStore(tmp_path, 1 << 20).entries() == store.entries()  # the index is the records'


# ---------------------------------------------------------------------------------------------- Prefect server


def test_the_services_prefect_server_answers_only_with_its_auth_string(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve`'s own Prefect server: on loopback, on a port of its own, and every API call but the health check
    needs the auth string kept owner-only in its folder, which its job processes inherit."""
    import base64
    import os
    import subprocess
    from urllib.parse import urlparse

    import httpx
    from prefect import flow
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from runtime import flow_leases, prefect_api, prefect_server

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    # Whatever API a test session set up (conftest's `prefect_server`), serve's own server is what is tested.
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        home = tmp_path / "prefect-server"
        try:
            with prefect_api.prefect_api(home, secured=True) as url:
                auth = prefect_server.server_auth(home)
                assert auth and (home / "auth").stat().st_mode & 0o777 == 0o600
                assert urlparse(url).hostname == "127.0.0.1" and urlparse(url).port != prefect_server.DEFAULT_PORT
                assert os.environ["PREFECT_API_AUTH_STRING"] == auth and os.environ["PREFECT_API_URL"] == url
                assert httpx.get(f"{url}/health", timeout=10).status_code == 200
                for headers in ({}, {"Authorization": "Basic " + base64.b64encode(b"guess").decode()}):
                    assert (
                        httpx.post(f"{url}/flow_runs/filter", json={}, headers=headers, timeout=10).status_code == 401
                    )
                token = base64.b64encode(auth.encode()).decode()
                answer = httpx.post(f"{url}/flow_runs/filter", json={}, headers={"Authorization": f"Basic {token}"})
                assert answer.status_code == 200, answer.text

                from prefect.client.orchestration import get_client

                with get_client(sync_client=True) as client:  # the settings a job process inherits
                    assert client.read_flow_runs() == []
                    run = client.create_flow_run(flow(name="k6vsr-test-noop")(lambda: None))

            # Outside the block, as the next command: a run whose process died is still marked Crashed, with the
            # auth string the server's folder holds.
            gone = subprocess.Popen(["true"])
            gone.wait()
            lease = flow_leases.Lease(
                flow_run_id=str(run.id),
                pid=gone.pid,
                host=socket.gethostname(),
                api_url=url,
                api=f"local:{home.resolve()}",
                started_at="2026-01-01T00:00:00+00:00",
            )
            (home / "leases").mkdir(exist_ok=True)
            (home / "leases" / f"{run.id}.json").write_text(lease.model_dump_json())
            assert "PREFECT_API_AUTH_STRING" not in os.environ
            assert flow_leases.mark_crashed_runs(url, home) == [str(run.id)]
        finally:
            prefect_server.stop_server(home)


# ---------------------------------------------------------------------------------------- memory, pages, fairness


def test_a_job_over_the_memory_budget_is_refused_at_submit(tmp_path: Path, tiny_bundle_path: Path) -> None:
    """The probe: a few kilobytes of video within every other cap whose frames, latents and result would not fit the
    host memory the server may use: 400 naming --memory-budget-mb, and nothing left behind. A small job fits."""
    from entrypoints.server.host_memory import DEFAULT_WORKER_BYTES, job_bytes
    from service.runs import prepare_run

    big = make_sample_clip(tmp_path / "big.mp4", width=512, height=512, num_frames=33, audio=False)
    small = make_sample_clip(tmp_path / "small.mp4", width=64, height=64, num_frames=1, audio=False)
    assert big.stat().st_size < 100 << 10
    spec = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    params = {"scale": 4.0}
    from k6vsr_core.contract.params import parse_params

    big_bytes = job_bytes(prepare_run(big, parse_params(**params), spec, tmp_path / "plans").plan, on_cpu=True)
    small_bytes = job_bytes(prepare_run(small, parse_params(**params), spec, tmp_path / "plans").plan, on_cpu=True)
    assert small_bytes < 64 << 20 < big_bytes
    # The budget: the server's size, a worker's, and room for the small job but not the big one.
    from entrypoints.server.host_memory import own_rss

    budget = own_rss() + DEFAULT_WORKER_BYTES + (256 << 20)
    assert big_bytes > 256 << 20, big_bytes
    store = tmp_path / "store"
    client = TestClient(app_for(store, tiny_bundle_path, replace(LIMITS, memory_budget_bytes=budget)))
    error = error_of(upload(client, big, KEY_A, sr_resolution_scale="4"), 400, [str(tmp_path)])
    assert error["code"] == "memory_too_large" and "--memory-budget-mb" in error["message"], error
    assert not list((store / "jobs").iterdir())
    assert upload(client, small, KEY_A, sr_resolution_scale="4").status_code == 200


def test_the_memory_watch_stops_a_job_that_outgrows_the_budget(tmp_path: Path) -> None:
    """Whatever the estimate said: once the server and its workers pass the budget, the largest running job's
    process is stopped, and the job fails naming the budget. An idle worker is measured, never stopped."""
    import signal
    import subprocess
    import sys

    from entrypoints.server.host_memory import own_rss

    store = JobStore(tmp_path, 1 << 20)
    limits = replace(LIMITS, retention_s=60, memory_budget_bytes=own_rss() + (64 << 20))
    runner = JobRunner(store, ModelSpec(model="unused"), 1, limits)
    slot = runner.slots[0]
    # A stand-in for a job process that holds 200 MB.
    slot.process = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; x = bytearray(200 << 20); print(flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert slot.process.stdout is not None and slot.process.stdout.readline() == "\n"
        assert runner.memory is not None
        runner.memory.worker_bytes = 0  # below the stand-in's size, to see it measured
        runner.check_memory()  # idle: its size is measured (what admission counts a worker at), nothing stopped
        assert slot.process.poll() is None and runner.memory.worker_bytes > 200 << 20
        assert runner.memory.job_room(1) < 0  # no job fits beside it
        slot.current = "video_abcdefghijklmnopqr"
        runner.check_memory()
        assert slot.process.wait(timeout=10) == -signal.SIGKILL
        assert slot.over_memory is not None and "--memory-budget-mb" in slot.over_memory
    finally:
        if slot.process.poll() is None:
            slot.process.kill()


def test_list_pages_and_a_keys_finished_jobs_are_capped(tmp_path: Path, tiny_bundle_path: Path) -> None:
    """Submit-and-cancel rounds past --max-finished-per-key leave that many records, the newest; the list comes in
    pages of `limit`, the next one after `last_id`, `has_more` until the last."""
    clip = make_sample_clip(tmp_path / "clip.mp4", width=64, height=64, num_frames=1, audio=False)
    store = tmp_path / "store"
    client = TestClient(app_for(store, tiny_bundle_path, replace(LIMITS, finished_per_key=5)))
    b = {"Authorization": f"Bearer {KEY_B}"}
    ids = []
    for round_ in range(8):
        posted = upload(client, clip, KEY_B, seed=str(round_)).json()["id"]
        assert client.delete(f"/v1/videos/{posted}", headers=b).json()["status"] == "cancelled"
        ids.append(posted)
    assert len(list((store / "jobs").glob("video_*.json"))) == 5
    pages, after = [], None
    while True:
        query = {"limit": "2", **({"after": after} if after else {})}
        page = client.get("/v1/videos", params=query, headers=b).json()
        pages.append([job["id"] for job in page["data"]])
        after = page["last_id"]
        if not page["has_more"]:
            break
    assert pages == [ids[3:5], ids[5:7], ids[7:]]
    for bad in ({"limit": "0"}, {"limit": "101"}, {"limit": "x"}):
        assert error_of(client.get("/v1/videos", params=bad, headers=b), 400)["param"] == "limit"
    assert error_of(client.get("/v1/videos", params={"after": ids[0]}, headers=b), 404)["param"] == "after"


def test_no_key_or_client_holds_every_upload_slot(served_anonymous: int, tmp_path: Path) -> None:
    """Without keys, four never-finishing uploads of one client address take half the four admission slots, not
    all: the others are refused, and a client at another address is taken at once. And no setting lets one key
    hold every slot: --max-uploads-per-key is lowered to half of --max-queued."""
    import httpx

    from entrypoints.cli import build_parser
    from entrypoints.server.app import config_from

    clip = make_sample_clip(tmp_path / "clip.mp4", width=64, height=64, num_frames=1, audio=False)
    stalled = [stalled_upload(served_anonymous, None)]
    try:
        time.sleep(0.3)
        stalled += [stalled_upload(served_anonymous, None) for _ in range(LIMITS.max_queued - 1)]
        time.sleep(0.3)
        refused = [answer_of(sock) for sock in stalled[2:]]
        assert all(status == 429 and body["error"]["code"] == "too_many_uploads" for status, body in refused), refused
        other = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(base_url=f"http://127.0.0.1:{served_anonymous}", transport=other, timeout=15) as client:
            files = {"video_reference": ("x.mp4", clip.read_bytes(), "video/mp4")}
            assert client.post("/v1/videos", files=files).status_code == 200
    finally:
        for sock in stalled:
            sock.close()
    flags = ["serve", "--max-queued", "4", "--max-uploads-per-key", "4"]
    assert config_from(build_parser().parse_args(flags), tmp_path, "m").limits.uploads_per_key == 2


# ---------------------------------------------------------------------------------------- start checks, framing


def test_keys_no_client_could_send_are_refused_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key with spaces around it (or a character outside printable ASCII) could never authenticate: `serve`
    refuses it at start, naming where it came from and never echoing it."""
    from entrypoints.cli import build_parser
    from entrypoints.server.app import config_from

    def config(*flags: str) -> ServerConfig:
        return config_from(build_parser().parse_args(["serve", *flags]), tmp_path / "store", "m")

    for flags, source in (
        (["--api-key", " secret-key-1"], "--api-key"),
        (["--api-key", "secret-key-1\t"], "--api-key"),
        (["--admin-key", "secret-key-1 "], "--admin-key"),
        (["--api-key", "secret-k\u00e9y"], "--api-key"),
    ):
        with pytest.raises(ParameterError) as refused:
            config(*flags)
        assert str(refused.value).startswith(source) and "secret" not in str(refused.value), refused.value
    monkeypatch.setenv("K6VSR_API_KEY", "secret-key-1\n")
    with pytest.raises(ParameterError, match="^K6VSR_API_KEY: a key has leading or trailing spaces"):
        config()
    monkeypatch.delenv("K6VSR_API_KEY")
    assert config("--api-key", "secret-key-1", "--admin-key", "admin key 2").admin_keys == ("admin key 2",)


def test_a_store_inside_an_allowed_folder_is_refused_at_start(tmp_path: Path) -> None:
    """With the store inside an --allow-path folder (or one inside the store), a `video_path` could read another
    key's inputs and outputs: `serve` refuses that layout; folders side by side are fine."""
    from entrypoints.cli import build_parser
    from entrypoints.server.app import config_from

    (tmp_path / "store" / "jobs").mkdir(parents=True)
    (tmp_path / "clips").mkdir()
    for allowed, store in ((tmp_path, tmp_path / "store"), (tmp_path / "store" / "jobs", tmp_path / "store")):
        args = build_parser().parse_args(["serve", "--allow-path", str(allowed)])
        with pytest.raises(ParameterError, match="overlaps the server's store"):
            config_from(args, store, "m")
    args = build_parser().parse_args(["serve", "--allow-path", str(tmp_path / "store")])
    with pytest.raises(ParameterError, match="overlaps the server's store"):  # the run store on this disk
        config_from(args, tmp_path / "elsewhere", "m", run_root=tmp_path / "store")
    args = build_parser().parse_args(["serve", "--allow-path", str(tmp_path / "clips")])
    assert config_from(args, tmp_path / "store", "m").allow_paths == ((tmp_path / "clips").resolve(),)


def test_an_unplannable_target_names_no_server_path(tmp_path: Path, tiny_bundle_path: Path) -> None:
    """The probe: `sr_target_resize_mode: exact` with a target above the result. 400 saying why, without the
    path of the job's input in the store."""
    clip = make_sample_clip(tmp_path / "clip.mp4", width=64, height=64, num_frames=1, audio=False)
    client = TestClient(app_for(tmp_path / "store", tiny_bundle_path))
    answer = upload(
        client, clip, KEY_A, sr_resolution_scale="2", sr_target_resolution="2000x2000", sr_target_resize_mode="exact"
    )
    error = error_of(answer, 400, [str(tmp_path), "/jobs/", "<path>", "<store>"])
    assert error["code"] == "invalid_value" and error["message"].startswith("target 2000x2000"), error


def test_a_request_framed_twice_closes_its_connection(served: int) -> None:
    """Content-Length beside Transfer-Encoding: answered (by the chunked body), then the connection is closed
    (RFC 9112, 6.1); a request framed once keeps its connection."""
    body = b'{"video_path": "/nowhere/x.mp4"}'
    with socket.create_connection(("127.0.0.1", served), timeout=15) as sock:
        sock.sendall(
            b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY_A.encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n" % len(body)
            + body
            + b"\r\n0\r\n\r\n"
        )
        status, _ = answer_of(sock)
        assert status == 403
        try:  # a next request on it finds it closed: no answer
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n\r\n".encode())
            assert sock.recv(65536) == b""
        except (BrokenPipeError, ConnectionResetError):
            pass
    with socket.create_connection(("127.0.0.1", served), timeout=15) as sock:
        for _ in range(2):  # the same connection answers twice
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n\r\n".encode())
            assert answer_of(sock)[0] == 200


def test_accept_errors_log_one_line_without_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """Out of descriptors, asyncio reports every failed accept; the server logs one line for many, with no
    traceback (formatting one reads source files, which fails too), and passes any other error on."""
    import asyncio
    import errno
    import logging

    from entrypoints.server.serving import AcceptErrorLog

    handler = AcceptErrorLog()
    loop = asyncio.new_event_loop()
    passed_on: list[dict[str, Any]] = []
    loop.default_exception_handler = passed_on.append  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.WARNING, logger="k6vsr.server"):
            for _ in range(50):
                exc = OSError(errno.EMFILE, "Too many open files")
                handler(loop, {"message": "socket.accept() out of system resource", "exception": exc})
            handler(loop, {"message": "something else", "exception": ValueError("x")})
    finally:
        loop.close()
    lines = [record for record in caplog.records if record.name == "k6vsr.server"]
    assert len(lines) == 1 and lines[0].exc_info is None and "EMFILE" in lines[0].getMessage(), lines
    assert [context["message"] for context in passed_on] == ["something else"]
