"""A real `k6vsr serve` process on loopback for the HTTP API tests, and the helpers that drive it."""

from __future__ import annotations

import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import av
import httpx
import numpy as np

from k6vsr_core import media

JOB_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A `k6vsr serve` process on a free loopback port, on `store` with the tiny `bundle`, with `args` added."""

    def __init__(
        self,
        root: Path,
        store: Path,
        bundle: Path,
        name: str,
        args: list[str],
        key: str | None,
        nofile: int | None = None,
    ) -> None:
        self.store, self.bundle, self.args = store, bundle, args
        self.nofile = nofile  # the server's open-file limit (soft and hard), if not this process's
        self.port = free_port()
        self.log_path = root / f"{name}.log"
        self.process: subprocess.Popen | None = None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", headers=headers, timeout=30)

    def start(self) -> Server:
        command = [
            sys.executable,
            "-m",
            "entrypoints.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--store",
            str(self.store),
            "--model",
            str(self.bundle),
            "--device",
            "cpu",
            *self.args,
        ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy(), preexec_fn=self._limit_files
            )
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

    def _limit_files(self) -> None:
        if self.nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

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

    def as_key(self, key: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.client.base_url, headers=headers, timeout=30)

    def post_json(self, **body: Any) -> httpx.Response:
        return self.client.post("/v1/videos", json=body)

    def post_upload(self, clip: Path | bytes, client: httpx.Client | None = None, **fields: Any) -> httpx.Response:
        data = clip if isinstance(clip, bytes) else clip.read_bytes()
        files = {"video_reference": ("any name/../x.mp4", data, "video/mp4")}
        return (client or self.client).post("/v1/videos", files=files, data={k: str(v) for k, v in fields.items()})

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

    def delete_until_gone(self, job_id: str, timeout_s: float = 30) -> None:
        """Cancel, then delete once the worker has stopped."""
        deadline = time.monotonic() + timeout_s
        while (response := self.client.delete(f"/v1/videos/{job_id}")).status_code != 404:
            if response.status_code == 200 and response.json().get("deleted"):
                return
            assert time.monotonic() < deadline, response.text
            time.sleep(0.2)

    def post_chunked(self, headers: dict[str, str], chunks: Iterable[bytes]) -> tuple[int, bytes, int]:
        """POST /v1/videos with a chunked body over a raw socket, sending until the server answers.

        Returns the status, the body, and how many body bytes were sent before the answer came.
        """
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        head = [
            "POST /v1/videos HTTP/1.1",
            "Host: 127.0.0.1",
            "Transfer-Encoding: chunked",
            *(
                f"{name}: {value}"
                for name, value in {**self.client.headers, **headers}.items()
                if name.lower() in ("authorization", "content-type")
            ),
        ]
        sent = 0
        with sock:
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
            try:
                for chunk in chunks:
                    if select.select([sock], [], [], 0)[0]:
                        break  # the server answered: stop sending
                    sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                    sent += len(chunk)
                else:
                    sock.sendall(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                pass
            answer = b""
            try:
                while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
                    data = sock.recv(65536)
                    if not data:
                        break
                    answer += data
            except (ConnectionResetError, TimeoutError):
                pass
        head_bytes, _, body = answer.partition(b"\r\n\r\n")
        return int(head_bytes.split(b" ", 2)[1]), body, sent


def _length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


# ---------------------------------------------------------------------------------------------- checks


def completed(server: Server, response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["object"] == "video" and job["id"].startswith("video_") and job["status"] in ("queued", "in_progress")
    done = server.wait(job["id"])
    assert done["status"] == "completed", done
    assert done["progress"] == 100 and done["error"] is None and done["completed_at"] >= done["created_at"]
    return done


def error_of(response: httpx.Response, status: int, secrets: Iterable[str] = ()) -> dict[str, Any]:
    """The error of `response`: JSON with a code and a one-line message, and none of `secrets` (server paths)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]["message"] and body["error"]["type"], body
    assert body["error"]["code"] and "\n" not in body["error"]["message"], body
    assert "Traceback" not in response.text
    for secret in secrets:
        assert secret not in response.text, (secret, body)
    return body["error"]


def frames_of(path: Path) -> np.ndarray:
    """Every frame of a video, as RGB."""
    count, pts = media.scan_frames(path)
    return media.read_frames(path, list(range(count)), pts)


def has_audio_stream(path: Path) -> bool:
    with av.open(str(path)) as container:
        return len(container.streams.audio) > 0


def modes_under(root: Path) -> dict[str, int]:
    """Permission bits of every file and folder under `root`, and of `root`."""
    found = {str(root): root.stat().st_mode & 0o777}
    for path in root.rglob("*"):
        if not path.is_symlink():
            found[str(path)] = path.stat().st_mode & 0o777
    return found
