"""The HTTP job API (`k6vsr serve`), driven over real HTTP on loopback with the tiny random bundle.

One server runs for the module (a real `python -m entrypoints.cli serve` process with an API key, one allowed folder and
a 1 MB upload cap) on one store; the restart test kills a first server mid-job and that module server resumes the job.
Clips are 1-frame and 64 px, so every job has 1 tile (x2, x2.25) or 9 (x4).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import av
import httpx
import numpy as np
import pytest

from k6vsr_core import media
from k6vsr_core.params import parse_params
from k6vsr_core.sample import make_sample_clip
from service.runs import ModelSpec, prepare_run

KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
JOB_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A `k6vsr serve` process on a free loopback port."""

    def __init__(self, stack: dict[str, Path], name: str) -> None:
        self.stack = stack
        self.port = _free_port()
        self.log_path = stack["root"] / f"{name}.log"
        self.process: subprocess.Popen | None = None
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", headers=AUTH, timeout=30)

    def start(self) -> Server:
        command = [
            sys.executable, "-m", "entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
            "--store", str(self.stack["store"]), "--model", str(self.stack["bundle"]), "--device", "cpu",
            "--allow-path", str(self.stack["allowed"]), "--api-key", KEY, "--max-upload-mb", "1",
        ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"server exited:\n{self.log()}"
            try:
                if self.client.get("/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server did not answer in 120 s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.client.close()

    # ------------------------------------------------------------------------------------------ requests

    def post_json(self, **body: Any) -> httpx.Response:
        return self.client.post("/v1/videos", json=body)

    def post_upload(self, clip: Path, **fields: Any) -> httpx.Response:
        files = {"video_reference": ("any name/../x.mp4", clip.read_bytes(), "video/mp4")}
        return self.client.post("/v1/videos", files=files, data={k: str(v) for k, v in fields.items()})

    def job(self, job_id: str) -> dict[str, Any]:
        response = self.client.get(f"/v1/videos/{job_id}")
        assert response.status_code == 200, response.text
        return response.json()

    def wait(self, job_id: str, until: tuple[str, ...] = ("completed", "failed", "cancelled")) -> dict[str, Any]:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["status"] in until:
                return job
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} still {job['status']} after {JOB_TIMEOUT_S} s:\n{self.log()}")

    def content(self, job_id: str, to: Path) -> Path:
        response = self.client.get(f"/v1/videos/{job_id}/content")
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "video/mp4"
        to.write_bytes(response.content)
        return to


def completed(server: Server, response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["object"] == "video" and job["id"].startswith("video_") and job["status"] in ("queued", "in_progress")
    done = server.wait(job["id"])
    assert done["status"] == "completed", done
    assert done["progress"] == 100 and done["error"] is None and done["completed_at"] >= done["created_at"]
    return done


def frames_of(path: Path) -> np.ndarray:
    return media.decode_frames(path)[0]


def has_audio_stream(path: Path) -> bool:
    with av.open(str(path)) as container:
        return len(container.streams.audio) > 0


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]["message"] and body["error"]["type"], body
    assert "Traceback" not in response.text
    return body["error"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_bundle_path: Path, prefect_server: str) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    make_sample_clip(allowed / "square.mp4", width=64, height=64, num_frames=1)
    make_sample_clip(allowed / "wide.mp4", width=96, height=64, num_frames=1)
    make_sample_clip(allowed / "silent.mp4", width=64, height=64, num_frames=1, audio=False)
    make_sample_clip(outside / "secret.mp4", width=64, height=64, num_frames=1)
    (allowed / "escape.mp4").symlink_to(outside / "secret.mp4")
    (allowed / "broken.mp4").write_bytes(b"this is not a video" * 100)
    return {"root": root, "allowed": allowed, "outside": outside, "store": root / "store", "bundle": tiny_bundle_path}


@pytest.fixture(scope="module")
def server(stack: dict[str, Path]):
    running = Server(stack, "server").start()
    yield running
    running.stop()


def _worker_children_of(pid: int) -> list[int]:
    """Job worker processes started by server `pid` that are still alive (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"entrypoints.jobs" in argv and str(pid).encode() in argv:
                found.append(int(entry.name))
    return found


# Runs first: a server killed with a job in progress, then the module server on the same store, which resumes it.
def test_server_restart_mid_job_resumes_it(stack: dict[str, Path], request: pytest.FixtureRequest) -> None:
    first = Server(stack, "first").start()
    try:
        posted = first.post_json(video_path=str(stack["allowed"] / "square.mp4"), sr_resolution_scale=2)
        assert posted.status_code == 200, posted.text
        job_id = posted.json()["id"]
        assert first.wait(job_id, until=("in_progress", "completed"))["status"] == "in_progress"
        first.kill()
    finally:
        first.stop()
    record = (stack["store"] / "jobs" / f"{job_id}.json").read_text()
    assert '"status": "in_progress"' in record
    if sys.platform.startswith("linux"):
        deadline = time.monotonic() + 10  # the worker dies with its server
        while _worker_children_of(first.process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _worker_children_of(first.process.pid)

    server: Server = request.getfixturevalue("server")  # a new server on the same store
    done = server.wait(job_id)
    assert done["status"] == "completed", done
    assert done["output"]["width"] == 128 and done["output"]["frames"] == 1


@pytest.mark.parametrize(
    ("scale", "clip", "size"),
    [("2", "square.mp4", (128, 128)), ("4", "square.mp4", (256, 256)), ("2.25", "wide.mp4", (224, 128))],
)
def test_json_and_upload_give_the_same_frames(
    server: Server, stack: dict[str, Path], tmp_path: Path, scale: str, clip: str, size: tuple[int, int]
) -> None:
    source = stack["allowed"] / clip
    by_path = completed(server, server.post_json(video_path=str(source), sr_resolution_scale=float(scale)))
    by_upload = completed(server, server.post_upload(source, sr_resolution_scale=scale))
    assert by_upload["run_key"] == by_path["run_key"]
    assert by_upload["source"] == {"type": "upload"} and by_path["source"]["video_path"] == str(source)
    assert by_path["params"]["sr_resolution_scale"] == float(scale)
    assert by_path["size"] == f"{size[0]}x{size[1]}"

    a = server.content(by_path["id"], tmp_path / "path.mp4")
    b = server.content(by_upload["id"], tmp_path / "upload.mp4")
    frames_a, frames_b = frames_of(a), frames_of(b)
    assert frames_a.shape == (1, size[1], size[0], 3)
    assert np.array_equal(frames_a, frames_b)
    probe = media.probe(a)
    assert (probe.width, probe.height, probe.num_frames, round(probe.fps)) == (*size, 1, 24)
    assert has_audio_stream(a) and has_audio_stream(b)
    assert by_path["output"]["has_audio"] is True and by_path["output"]["bytes"] == a.stat().st_size


def test_repeated_request_reuses_the_run_and_delete_removes_the_job(
    server: Server, stack: dict[str, Path], tmp_path: Path
) -> None:
    body = {"video_path": str(stack["allowed"] / "square.mp4"), "sr_resolution_scale": 2, "seed": 5}
    first = completed(server, server.post_json(**body))
    again = completed(server, server.post_json(**body))
    assert again["run_key"] == first["run_key"] and again["id"] != first["id"]
    assert again["tiles"]["reused"] == again["tiles"]["total"] and again["tiles"]["computed"] == 0
    assert np.array_equal(
        frames_of(server.content(first["id"], tmp_path / "1.mp4")),
        frames_of(server.content(again["id"], tmp_path / "2.mp4")),
    )

    jobs = stack["store"] / "jobs"
    assert (jobs / again["id"] / "output.mp4").is_file()
    deleted = server.client.delete(f"/v1/videos/{again['id']}")
    assert deleted.status_code == 200 and deleted.json() == {"id": again["id"], "object": "video.deleted",
                                                              "deleted": True}
    assert not (jobs / again["id"]).exists() and not (jobs / f"{again['id']}.json").exists()
    error_of(server.client.get(f"/v1/videos/{again['id']}"), 404)
    assert (stack["store"] / "runs" / first["run_key"] / "output.mp4").is_file()  # the shared run is kept
    assert server.client.get(f"/v1/videos/{first['id']}/content").status_code == 200


def test_silent_source_gives_a_video_only_mp4(server: Server, stack: dict[str, Path], tmp_path: Path) -> None:
    done = completed(server, server.post_json(video_path=str(stack["allowed"] / "silent.mp4"), sr_resolution_scale=2))
    assert done["output"]["has_audio"] is False
    out = server.content(done["id"], tmp_path / "silent.mp4")
    assert not has_audio_stream(out)
    assert frames_of(out).shape == (1, 128, 128, 3)


def test_tile_batch_2_is_its_own_run(server: Server, stack: dict[str, Path], tmp_path: Path) -> None:
    source = stack["allowed"] / "wide.mp4"  # 2 tiles at x2: one chunk of 2 with batch 2
    done = completed(server, server.post_upload(source, sr_resolution_scale=2, sr_tiles_batch_size=2))
    assert done["params"]["sr_tiles_batch_size"] == 2 and done["tiles"]["total"] == 2
    spec = ModelSpec(model=str(stack["bundle"]), device="cpu")
    keys = {
        batch: prepare_run(source, parse_params(scale=2, tiles_batch_size=batch), spec, stack["store"]).run.run_key
        for batch in (1, 2)
    }
    assert done["run_key"] == keys[2] != keys[1]
    assert frames_of(server.content(done["id"], tmp_path / "b2.mp4")).shape == (1, 128, 192, 3)


def test_refusals(server: Server, stack: dict[str, Path]) -> None:
    allowed, outside = stack["allowed"], stack["outside"]
    jobs = stack["store"] / "jobs"
    before = sorted(p.name for p in jobs.iterdir())
    url = "/v1/videos"

    # Missing or wrong key, on every route.
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        anonymous = httpx.Client(base_url=server.client.base_url, headers=headers)
        error_of(anonymous.get(url), 401)
        error_of(anonymous.get(f"{url}/video_abcdefghijklmnopqrstuvwx"), 401)
        error_of(anonymous.post(url, json={"video_path": str(allowed / "square.mp4")}), 401)
        error_of(anonymous.get("/health"), 401)
        anonymous.close()

    # Paths outside the allowed folder, through `..`, or through a symbolic link.
    for path in (outside / "secret.mp4", allowed / ".." / "outside" / "secret.mp4", allowed / "escape.mp4",
                 Path("/etc/passwd")):
        error = error_of(server.post_json(video_path=str(path)), 403)
        assert error["param"] == "video_path" and error["type"] == "permission_error"

    # Uploads beyond the 1 MB cap, with a Content-Length and streamed without one.
    big = os.urandom(3 << 19)
    error_of(server.client.post(url, files={"video_reference": ("a.mp4", big)}), 413)
    boundary = "k6vsr-test-boundary"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="video_reference"; filename="a.mp4"\r\n\r\n'.encode()
            + big + f"\r\n--{boundary}--\r\n".encode())
    chunks = (body[i: i + 65536] for i in range(0, len(body), 65536))
    form_type = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    streamed = server.client.post(url, content=chunks, headers=form_type)  # chunked: no Content-Length
    assert error_of(streamed, 413)["param"] == "video_reference"

    # Bad parameters name their field.
    square = str(allowed / "square.mp4")
    for field, value in [("sr_resolution_scale", 3), ("sr_resolution_scale", "x2"), ("sr_tiles_batch_size", 0),
                         ("sr_tile_min_overlap", 1.5), ("sr_target_resolution", "8k"),
                         ("sr_target_resize_mode", "zoom"), ("seed", -1), ("seed", "abc"),
                         ("num_inference_steps", 0), ("sr_unknown", 1)]:
        error = error_of(server.post_json(video_path=square, **{field: value}), 400)
        assert error["param"] == field and field in error["message"], error
    error = error_of(server.post_upload(allowed / "square.mp4", sr_resolution_scale="3"), 400)
    assert error["param"] == "sr_resolution_scale"

    # Broken clips, missing fields, wrong bodies.
    assert "broken.mp4" in error_of(server.post_json(video_path=str(allowed / "broken.mp4")), 400)["message"]
    assert error_of(server.post_upload(allowed / "broken.mp4"), 400)["param"] == "video_reference"
    error_of(server.post_json(video_path=str(allowed / "missing.mp4")), 400)
    error_of(server.post_json(sr_resolution_scale=2), 400)
    error_of(server.client.post(url, content=b"{not json", headers={"Content-Type": "application/json"}), 400)
    error_of(server.client.post(url, files={"other": ("a.mp4", b"x")}), 400)
    error_of(server.client.post(url, content=b"x", headers={"Content-Type": "text/plain"}), 415)
    error_of(server.client.get(f"{url}/video_doesnotexist_0123456789"), 404)
    error_of(server.client.get(f"{url}/..%2F..%2Fetc%2Fpasswd"), 404)
    error_of(server.client.get("/nowhere"), 404)

    assert sorted(p.name for p in jobs.iterdir()) == before  # refused requests leave nothing in the store


# Runs last: cancelling a running job restarts its worker process, which the tests after it would wait for.
def test_cancel_and_delete(server: Server, stack: dict[str, Path]) -> None:
    square = str(stack["allowed"] / "square.mp4")
    running = server.post_json(video_path=square, sr_resolution_scale=4, seed=7).json()
    waiting = server.post_json(video_path=square, sr_resolution_scale=4, seed=8).json()
    assert server.wait(running["id"], until=("in_progress", "completed"))["status"] == "in_progress"
    assert server.job(waiting["id"])["status"] == "queued"
    assert error_of(server.client.get(f"/v1/videos/{waiting['id']}/content"), 409)["code"] == "job_queued"

    cancelled = server.client.delete(f"/v1/videos/{waiting['id']}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    cancelled = server.client.delete(f"/v1/videos/{running['id']}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    time.sleep(0.5)
    for job_id in (running["id"], waiting["id"]):
        assert server.job(job_id)["status"] == "cancelled"
        assert error_of(server.client.get(f"/v1/videos/{job_id}/content"), 409)["code"] == "job_cancelled"

    # A second DELETE removes the cancelled job (once its worker has stopped).
    deadline = time.monotonic() + 30
    while (response := server.client.delete(f"/v1/videos/{running['id']}")).status_code == 409:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert response.status_code == 200 and response.json()["deleted"] is True
    assert server.client.delete(f"/v1/videos/{waiting['id']}").json()["deleted"] is True
    for job_id in (running["id"], waiting["id"]):
        error_of(server.client.get(f"/v1/videos/{job_id}"), 404)
        assert not (stack["store"] / "jobs" / f"{job_id}.json").exists()


@pytest.mark.parametrize("chunk", [1, 7, 70, 65536])
def test_form_parser_handles_any_chunking(tmp_path: Path, chunk: int) -> None:
    """Boundaries split across reads, CRLF and dashes inside the data: the parser still cuts at the boundary."""
    import asyncio

    from starlette.requests import Request

    from entrypoints.http_api import read_form

    boundary = "b0undary"
    payload = b"x--b0undary\r\n--b0undar\r\n-b0undary\r\n\r\n" * 40 + bytes(range(256))  # near misses only
    body = (
        f"--{boundary}\r\n".encode()
        + b'Content-Disposition: form-data; name="seed"\r\n\r\n7\r\n'
        + f"--{boundary}\r\n".encode()
        + b'Content-Disposition: form-data; name="video_reference"; filename="../../etc/x"\r\n'
        + b"Content-Type: video/mp4\r\n\r\n" + payload + b"\r\n"
        + f"--{boundary}\r\n".encode()
        + b'Content-Disposition: form-data; name="sr_target_resolution"\r\n\r\nhd\r\n'
        + f"--{boundary}--\r\nepilogue".encode()
    )
    pieces = [body[i: i + chunk] for i in range(0, len(body), chunk)]

    async def receive() -> dict:
        return {"type": "http.request", "body": pieces.pop(0) if pieces else b"", "more_body": bool(pieces)}

    scope = {"type": "http", "method": "POST", "path": "/v1/videos",
             "headers": [(b"content-type", f'multipart/form-data; boundary="{boundary}"'.encode())]}
    target = tmp_path / "input"
    fields = asyncio.run(read_form(Request(scope, receive), target, max_bytes=len(payload)))
    assert fields == {"seed": "7", "sr_target_resolution": "hd"}
    assert target.read_bytes() == payload
    assert sorted(p.name for p in tmp_path.iterdir()) == ["input"]


def test_video_path_needs_an_allowed_folder(tmp_path: Path) -> None:
    from entrypoints.http_api import ApiError, resolve_video_path

    clip = make_sample_clip(tmp_path / "a.mp4", width=64, height=64, num_frames=1)
    with pytest.raises(ApiError) as refused:
        resolve_video_path(str(clip), ())
    assert refused.value.status == 403 and "--allow-path" in refused.value.message
    assert resolve_video_path(str(tmp_path / "x" / ".." / "a.mp4"), (tmp_path.resolve(),)) == clip.resolve()
    with pytest.raises(ApiError) as refused:
        resolve_video_path("a\0b", (tmp_path.resolve(),))
    assert refused.value.status == 400
