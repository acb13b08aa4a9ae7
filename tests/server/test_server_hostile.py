"""The HTTP server against a hostile client, on loopback: floods of half-open and idle connections, deletes racing
each other and downloads, a SIGTERM mid-job.

The module server runs as `k6vsr serve` under an open-file limit of 1024 (as `ulimit -n 1024`), with two keys, a
1 s deadline for request heads and a 1 s keep-alive. The flood sockets are this process's: it raises its own soft
limit for them and puts it back.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import resource
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fault_harness import child_environment, fired
from http_harness import Server, completed

from k6vsr_core.media.sample import make_sample_clip

ROOT = Path(__file__).resolve().parents[2]
KEY_A, KEY_B = "key-a-0123456789abcdef", "key-b-0123456789abcdef"
NOFILE = 1024
HALF_OPEN = 1100  # more than the server's open-file limit


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_bundle_path: Path, prefect_server: str) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile")
    allowed = root / "allowed"
    allowed.mkdir()
    make_sample_clip(allowed / "square.mp4", width=64, height=64, num_frames=1)
    return {"root": root, "allowed": allowed, "store": root / "store", "bundle": tiny_bundle_path}


def start(stack: dict[str, Path], name: str) -> Server:
    args = [
        "--allow-path",
        str(stack["allowed"]),
        "--api-key",
        KEY_A,
        "--api-key",
        KEY_B,
        "--max-upload-mb",
        "1",
        "--header-timeout-s",
        "1",
        "--keep-alive-s",
        "1",
    ]
    return Server(stack["root"], stack["store"], stack["bundle"], name, args, KEY_A, nofile=NOFILE).start()


@pytest.fixture(scope="module")
def server(stack: dict[str, Path]) -> Iterator[Server]:
    running = start(stack, "hostile")
    yield running
    running.stop()


@contextmanager
def open_files(count: int) -> Iterator[None]:
    """This process's soft open-file limit raised to at least `count` (within the hard limit), then put back."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = count if hard == resource.RLIM_INFINITY else min(count, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (its end of file, or a reset, is there to read)."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):  # what it answered before (the idle ones' 200), if not read yet
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


@pytest.mark.timed
def test_half_open_and_idle_connections_cost_a_client_nothing(server: Server, stack: dict[str, Path]) -> None:
    """The probe: more connections that never finish their head than the server has file descriptors, and idle
    keep-alive ones beside them. Another client's requests are still answered at once, a job finishing meanwhile is
    recorded, the log does not grow with the attack, and the server closes every such connection at its deadline."""
    log_before = server.log_path.stat().st_size
    job = server.post_json(video_path=str(stack["allowed"] / "square.mp4"), sr_resolution_scale=2, seed=11).json()
    flood: list[socket.socket] = []
    with open_files(HALF_OPEN + 600):
        try:
            for _ in range(200):  # idle keep-alive: one request answered, then nothing
                sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
                sock.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_B}\r\n\r\n".encode())
                assert b" 200 " in sock.recv(65536)
                flood.append(sock)
            for _ in range(HALF_OPEN):  # half-open: a head that never ends
                sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                flood.append(sock)
            with httpx.Client(base_url=server.client.base_url, headers=server.client.headers, timeout=10) as other:
                for _ in range(5):
                    started = time.monotonic()
                    assert other.get("/health").status_code == 200
                    assert time.monotonic() - started < 3.0
            done = completed(server, httpx.Response(200, json=job, request=httpx.Request("GET", "/")))
            assert done["status"] == "completed"
            deadline = time.monotonic() + 10  # the 1 s head deadline, 1 s keep-alive, on a busy machine
            while not all(closed_by_server(sock) for sock in flood) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert all(closed_by_server(sock) for sock in flood)
        finally:
            for sock in flood:
                sock.close()
    assert server.client.get("/health").status_code == 200
    grown = server.log_path.stat().st_size - log_before
    assert grown < 64 << 10, server.log()
    assert "Too many open files" not in server.log_path.read_text(errors="replace")


def test_racing_deletes_answer_once_and_downloads_complete(server: Server, stack: dict[str, Path]) -> None:
    """20 DELETEs of one finished job at once, 10 downloads beside them: one deletes it, the others find it gone
    (404) or still stopping (409), never 500; every download that got its 200 has every byte."""
    job = server.post_json(video_path=str(stack["allowed"] / "square.mp4"), sr_resolution_scale=2, seed=12).json()
    done = server.wait(job["id"])
    assert done["status"] == "completed", done
    size = done["output"]["bytes"]
    base, headers = server.client.base_url, server.client.headers

    def delete(_: int) -> int:
        with httpx.Client(base_url=base, headers=headers, timeout=30) as client:
            return client.delete(f"/v1/videos/{job['id']}").status_code

    def download(_: int) -> tuple[int, int]:
        with httpx.Client(base_url=base, headers=headers, timeout=30) as client:
            response = client.get(f"/v1/videos/{job['id']}/content")
            return response.status_code, len(response.content)

    with concurrent.futures.ThreadPoolExecutor(30) as pool:
        downloads = [pool.submit(download, index) for index in range(10)]
        deletes = [pool.submit(delete, index) for index in range(20)]
        statuses = [future.result() for future in deletes]
        fetched = [future.result() for future in downloads]
    assert statuses.count(200) == 1 and set(statuses) <= {200, 404, 409}, statuses
    for status, length in fetched:
        assert (status == 200 and length == size) or status in (404, 409), fetched
    assert server.client.get(f"/v1/videos/{job['id']}").status_code == 404
    assert "internal error" not in server.log_path.read_text(errors="replace")


def flow_run_state(job_id: str) -> str | None:
    """The state of the flow run named after `job_id` on the tests' Prefect server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[job_id])))
    return runs[0].state.type.value if runs and runs[0].state else None


def test_sigterm_mid_job_leaves_no_running_flow_run(stack: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A server stopped with SIGTERM while a job's tile is computing, in a task thread that no signal stops: the
    job's child cannot end its flow run within its grace and is killed, yet once the server has exited the run is
    final (Crashed), not Running for good; the job stays in_progress for the next start to resume."""
    state = stack["root"] / "faults-sigterm"
    for name, value in child_environment(["stall@denoise:times=1"], state).items():
        monkeypatch.setenv(name, value)
    # This checkout's packages, not the install's, for the code the fault's start-up hook imports.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.environ["PYTHONPATH"], str(ROOT)]))
    stopped = start(stack, "sigterm")
    try:
        posted = stopped.post_json(video_path=str(stack["allowed"] / "square.mp4"), sr_resolution_scale=2, seed=13)
        job_id = posted.json()["id"]
        deadline = time.monotonic() + 60
        while not fired(state):  # the child is inside the stalled denoise
            assert time.monotonic() < deadline, stopped.log()
            time.sleep(0.1)
        assert flow_run_state(job_id) == "RUNNING"
    finally:
        stopped.stop()  # SIGTERM, and wait
    assert stopped.process is not None and stopped.process.returncode == 143, stopped.log()
    assert flow_run_state(job_id) == "CRASHED", stopped.log()
    assert json.loads((stack["store"] / "jobs" / f"{job_id}.json").read_text())["status"] == "in_progress"
