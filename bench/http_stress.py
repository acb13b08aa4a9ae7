"""A hostile-client stress of `k6vsr serve` on loopback, bounded in connections and time; rerun it to check the
server's bounds.

    python bench/http_stress.py [--half-open 2000] [--idle 2000] [--pipelined 1000] [--downloads 1000]
                                [--budget-mb 4096] [--deadline 900] [--out FILE]

It starts `k6vsr serve` on 127.0.0.1 (a free port, a store in a temporary folder, the tiny random bundle on the CPU,
two keys, `--memory-budget-mb`, and an open-file limit of 1024, as `ulimit -n 1024`), then:

1. unloaded: key B submits a job (9 tiles), polls it and downloads it; its time is the reference;
2. loaded: the same request (another seed, so it computes again) while this process holds `--half-open` connections
   that never finish their request head and `--idle` keep-alive connections (key A, one answered request each, then
   nothing), reopening whatever the server closes; it starts once every one of them was opened, and must finish
   within 2x the reference;
3. never read: the same request again while this process holds `--pipelined` connections (key A) that pipeline
   `GET /health` and never read an answer, then again beside `--downloads` connections (key A) that pipeline
   downloads of a finished job and never read them; each reopened a moment after the server drops it. Each job
   must finish within 3x the reference, and `/health`, asked every half second meanwhile, must answer within 2 s;
4. probes: an upload of a few KB whose plan would not fit the memory budget (must be refused, 4xx), a larger job
   (49 tiles) that fits, 20 DELETEs of a finished job at once beside 10 downloads of it (no 500; every 200
   download complete).

All along, the resident memory of the server process and of its job processes, and the server's open descriptors,
are sampled (psutil, every 0.1 s); their peaks must stay under the budget and the open-file limit. Every HTTP status
answered is counted; none may be a 500. Nothing but 127.0.0.1 is ever connected to. At the end the server, its
Prefect server and (without `--keep`) its temporary folder are removed. Exits 0 when every check holds, 1 otherwise;
the figures are printed as JSON (and written to `--out`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import resource
import select
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from k6vsr_core.media.sample import make_sample_clip  # noqa: E402
from k6vsr_core.model.tiny_bundle import make_tiny_bundle  # noqa: E402

HOST = "127.0.0.1"  # the only address this script connects to
KEY_A, KEY_B = "stress-key-a-0123456789", "stress-key-b-0123456789"
SERVER_NOFILE = 1024


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class Statuses:
    """Every HTTP status the probes got, and the transport errors (a connection closed before an answer)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()

    def add(self, what: int | str) -> None:
        with self.lock:
            self.counts[str(what)] += 1


class Memory(threading.Thread):
    """Peak resident memory of the server process and its job processes (`entrypoints.server.child`), sampled."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.server = psutil.Process(pid)
        self.peak = 0
        self.peak_jobs = 0
        self.peak_fds = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.1):
            try:
                total = self.server.memory_info().rss
                self.peak_fds = max(self.peak_fds, self.server.num_fds())
                jobs = 0
                for child in self.server.children(recursive=True):
                    try:
                        if "entrypoints.server.child" in " ".join(child.cmdline()):
                            jobs += child.memory_info().rss
                    except psutil.Error:
                        continue
            except psutil.Error:
                return
            self.peak = max(self.peak, total + jobs)
            self.peak_jobs = max(self.peak_jobs, jobs)


class Flood(threading.Thread):
    """Holds `half_open` connections that never finish their head and `idle` keep-alive ones, reopening those the
    server closes, until stopped. Counts what the server did to them."""

    def __init__(self, port: int, half_open: int, idle: int, statuses: Statuses) -> None:
        super().__init__(daemon=True)
        self.port, self.half_open, self.idle, self.statuses = port, half_open, idle, statuses
        self.stop = threading.Event()
        self.opened = Counter[str]()
        self.closed_by_server = Counter[str]()
        self.held = Counter[str]()
        self.peak_held = 0

    def _open(self, kind: str, selector: selectors.BaseSelector) -> None:
        try:
            sock = socket.create_connection((HOST, self.port), timeout=5)
            if kind == "half_open":
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Never: ")
            else:
                sock.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n\r\n".encode())
            sock.setblocking(False)
        except OSError:
            self.statuses.add(f"flood_connect_failed_{kind}")
            return
        selector.register(sock, selectors.EVENT_READ, kind)
        self.opened[kind] += 1
        self.held[kind] += 1

    def run(self) -> None:
        selector = selectors.DefaultSelector()
        try:
            while not self.stop.is_set():
                for kind, wanted in (("half_open", self.half_open), ("idle", self.idle)):
                    for _ in range(min(200, wanted - self.held[kind])):  # a bounded batch per turn
                        self._open(kind, selector)
                self.peak_held = max(self.peak_held, sum(self.held.values()))
                for key, _ in selector.select(timeout=0.05):
                    sock, kind = key.fileobj, key.data
                    try:
                        data = sock.recv(65536)  # type: ignore[union-attr]
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if data.startswith(b"HTTP/1.1 "):
                        self.statuses.add(int(data.split(b" ", 2)[1]))
                    if not data:
                        selector.unregister(sock)
                        sock.close()  # type: ignore[union-attr]
                        self.held[kind] -= 1
                        self.closed_by_server[kind] += 1
        finally:
            for key in list(selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            selector.close()


class NeverRead(threading.Thread):
    """Holds `count` connections that pipeline `request` (at most `most` times each, as fast as the server reads
    them) and never read an answer; one the server drops (a reset, or its end of file) is reopened 0.2-1 s later,
    and each is replaced after 5-20 s, since a close whose end of file waits behind unread answers is not seen."""

    def __init__(self, port: int, count: int, request: bytes, most: int, statuses: Statuses) -> None:
        super().__init__(daemon=True)
        self.port, self.count, self.request, self.most, self.statuses = port, count, request, most, statuses
        self.stop = threading.Event()
        self.opened = 0
        self.dropped_by_server = 0
        self.replaced = 0

    def _open(self) -> tuple[socket.socket, bytes] | None:
        sock = socket.socket()
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(5)
            sock.connect((HOST, self.port))
            sock.setblocking(False)
        except OSError:
            sock.close()
            self.statuses.add("never_read_connect_failed")
            return None
        self.opened += 1
        return sock, self.request * self.most

    def run(self) -> None:
        rng = random.Random(7)
        held: dict[socket.socket, tuple[bytes, float]] = {}  # each socket's unsent requests, and when to replace it
        wanted_at: list[float] = []
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                wanted_at.sort()
                while len(held) + len(wanted_at) < self.count:  # first turn, or one that failed to open
                    wanted_at.append(now)
                while wanted_at and wanted_at[0] <= now:
                    wanted_at.pop(0)
                    opened = self._open()
                    if opened is None:
                        wanted_at.append(now + 0.5)
                        break
                    held[opened[0]] = (opened[1], now + rng.uniform(5, 20))
                poller = select.poll()
                for sock in held:
                    poller.register(sock, select.POLLRDHUP | select.POLLERR | select.POLLHUP | select.POLLOUT)
                events = dict(poller.poll(100))
                for sock, (pending, replace_at) in list(held.items()):
                    event = events.get(sock.fileno(), 0)
                    gone = event & (select.POLLRDHUP | select.POLLERR | select.POLLHUP)
                    if gone or now >= replace_at:
                        del held[sock]
                        sock.close()
                        if gone:
                            self.dropped_by_server += 1
                        else:
                            self.replaced += 1
                        wanted_at.append(now + rng.uniform(0.2, 1.0))
                    elif pending and event & select.POLLOUT:
                        try:
                            held[sock] = (pending[sock.send(pending[: 1 << 16]) :], replace_at)
                        except (BlockingIOError, InterruptedError):
                            pass
                        except OSError:
                            held[sock] = (b"", replace_at)  # dropped: seen on a later turn
        finally:
            for sock in held:
                sock.close()


def health_during(client: httpx.Client, until: threading.Event, statuses: Statuses) -> list[float]:
    """`/health` asked every half second, each time on a new connection, until `until`: the seconds each took
    (None: no answer)."""
    times: list[Any] = []
    while not until.wait(0.5):
        started = time.monotonic()
        try:
            with httpx.Client(base_url=client.base_url, headers=client.headers, timeout=10) as probe:
                statuses.add(probe.get("/health").status_code)
            times.append(round(time.monotonic() - started, 3))
        except httpx.TransportError as err:
            statuses.add(f"health_transport_{type(err).__name__}")
            times.append(None)
    return times


def job_beside(
    attack: NeverRead, client: httpx.Client, clip: Path, seed: int, statuses: Statuses, deadline: float
) -> dict[str, Any]:
    """Key B's timed job and `/health` while `attack` runs, once all its connections were opened."""
    attack.start()
    while attack.opened < attack.count:
        assert time.monotonic() < deadline and attack.is_alive(), "the attack did not open its connections"
        time.sleep(0.2)
    done = threading.Event()
    health: list[Any] = []
    poller = threading.Thread(target=lambda: health.extend(health_during(client, done, statuses)), daemon=True)
    poller.start()
    try:
        job = timed_job(client, clip, seed, statuses, deadline)
    finally:
        done.set()
        poller.join(30)
        attack.stop.set()
        attack.join(60)
    answered = [seconds for seconds in health if seconds is not None]
    return {
        "job": job,
        "opened": attack.opened,
        "dropped_by_server": attack.dropped_by_server,
        "replaced_by_client": attack.replaced,
        "health_polls": len(health),
        "health_unanswered": len(health) - len(answered),
        "health_max_s": max(answered, default=None),
    }


def timed_job(client: httpx.Client, clip: Path, seed: int, statuses: Statuses, deadline: float) -> dict[str, Any]:
    """Submit, poll, download: the client's whole round trip, with its time."""
    started = time.monotonic()
    files = {"video_reference": ("clip.mp4", clip.read_bytes(), "video/mp4")}
    for attempt in range(2):
        try:
            response = client.post("/v1/videos", files=files, data={"sr_resolution_scale": "4", "seed": str(seed)})
            break
        except httpx.TransportError as err:  # its keep-alive connection closed at the cap as the longest idle
            statuses.add(f"transport_{type(err).__name__}")
            if attempt:
                raise
    statuses.add(response.status_code)
    response.raise_for_status()
    job_id = response.json()["id"]
    polls = 0
    while True:
        try:
            response = client.get(f"/v1/videos/{job_id}")
        except httpx.TransportError as err:
            statuses.add(f"transport_{type(err).__name__}")
            continue
        statuses.add(response.status_code)
        polls += 1
        job = response.json()
        status = job.get("status")
        if status in ("completed", "failed", "cancelled"):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {status} at the deadline")
        time.sleep(0.25)
    for attempt in range(2):
        try:
            content = client.get(f"/v1/videos/{job_id}/content")
            break
        except httpx.TransportError as err:  # as for the submit
            statuses.add(f"transport_{type(err).__name__}")
            if attempt:
                raise
    statuses.add(content.status_code)
    return {
        "id": job_id,
        "status": status,
        "seconds": round(time.monotonic() - started, 2),
        "polls": polls,
        "bytes": len(content.content),
        "whole": content.status_code == 200 and len(content.content) == job["output"]["bytes"],
    }


def race_probe(base: str, job_id: str, size: int, statuses: Statuses) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {KEY_B}"}

    def delete(_: int) -> int:
        with httpx.Client(base_url=base, headers=headers, timeout=60) as client:
            return client.delete(f"/v1/videos/{job_id}").status_code

    def download(_: int) -> tuple[int, int]:
        with httpx.Client(base_url=base, headers=headers, timeout=60) as client:
            response = client.get(f"/v1/videos/{job_id}/content")
            return response.status_code, len(response.content)

    with concurrent.futures.ThreadPoolExecutor(30) as pool:
        downloads = [pool.submit(download, index) for index in range(10)]
        deletes = [pool.submit(delete, index) for index in range(20)]
        delete_codes = [future.result() for future in deletes]
        fetched = [future.result() for future in downloads]
    for code in delete_codes:
        statuses.add(code)
    for code, _ in fetched:
        statuses.add(code)
    cut_short = sum(1 for code, length in fetched if code == 200 and length != size)
    return {"deletes": dict(Counter(delete_codes)), "downloads": dict(Counter(c for c, _ in fetched)), "cut": cut_short}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--half-open", type=int, default=2000)
    parser.add_argument("--idle", type=int, default=2000)
    parser.add_argument("--pipelined", type=int, default=1000, help="never-read connections pipelining /health")
    parser.add_argument("--downloads", type=int, default=1000, help="never-read connections pipelining downloads")
    parser.add_argument("--send-timeout-s", type=float, default=None, help="the server's --send-timeout-s")
    parser.add_argument("--send-buffer-kb", type=int, default=None, help="the server's --send-buffer-kb")
    parser.add_argument("--budget-mb", type=int, default=2048, help="the server's --memory-budget-mb")
    parser.add_argument("--deadline", type=float, default=900, help="seconds the whole run may take")
    parser.add_argument("--out", default=None)
    parser.add_argument("--keep", action="store_true", help="keep the temporary store, bundle and server log")
    args = parser.parse_args()
    kinds = (args.half_open, args.idle, args.pipelined, args.downloads)
    if not (all(0 <= count <= 5000 for count in kinds) and args.deadline <= 1800):
        parser.error("bounded: at most 5000 connections of each kind and 1800 s")
    deadline = time.monotonic() + args.deadline
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max(args.half_open + args.idle, args.pipelined, args.downloads) + 512  # the flood and the probes
    if soft != resource.RLIM_INFINITY and soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            parser.error(f"the hard open-file limit ({hard}) is under the {wanted} this run needs")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))

    work = Path(tempfile.mkdtemp(prefix="k6vsr-stress-"))
    bundle = make_tiny_bundle(work / "tiny")
    clip = make_sample_clip(work / "clip.mp4", width=64, height=64, num_frames=1, audio=False)
    medium = make_sample_clip(work / "medium.mp4", width=128, height=128, num_frames=1, audio=False)
    huge = make_sample_clip(work / "huge.mp4", width=512, height=512, num_frames=33, audio=False)
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "entrypoints.cli",
        "serve",
        "--host",
        HOST,
        "--port",
        str(port),
        "--store",
        str(work / "store"),
        "--model",
        str(bundle),
        "--device",
        "cpu",
        "--api-key",
        KEY_A,
        "--api-key",
        KEY_B,
        "--memory-budget-mb",
        str(args.budget_mb),
    ]
    if args.send_timeout_s is not None:
        command += ["--send-timeout-s", str(args.send_timeout_s)]
    if args.send_buffer_kb is not None:
        command += ["--send-buffer-kb", str(args.send_buffer_kb)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "K6VSR_STATE_HOME": str(work / "home")}
    env.pop("PREFECT_API_URL", None)  # serve's own Prefect server, in the store, as deployed

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (SERVER_NOFILE, SERVER_NOFILE))

    log = (work / "serve.log").open("wb")
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit_files)
    statuses = Statuses()
    result: dict[str, Any] = {
        "half_open": args.half_open,
        "idle": args.idle,
        "pipelined": args.pipelined,
        "downloads": args.downloads,
        "budget_mb": args.budget_mb,
        "send_timeout_s": args.send_timeout_s,
        "send_buffer_kb": args.send_buffer_kb,
    }
    checks: dict[str, bool] = {}
    base = f"http://{HOST}:{port}"
    memory = Memory(server.pid)
    try:
        client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=60)
        while True:
            assert server.poll() is None, (work / "serve.log").read_text()[-3000:]
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        memory.start()
        timed_job(client, clip, 1, statuses, deadline)  # warms the worker: its first job loads what it needs
        unloaded = timed_job(client, clip, 2, statuses, deadline)
        result["unloaded"] = unloaded

        started_flood = time.monotonic()
        flood = Flood(port, args.half_open, args.idle, statuses)
        flood.start()
        # The flood at full strength before the client starts: every connection of both kinds opened once.
        while flood.opened["half_open"] < args.half_open or flood.opened["idle"] < args.idle:
            assert time.monotonic() < deadline and flood.is_alive(), "the flood did not open its connections"
            time.sleep(0.2)
        result["flood_ramp_s"] = round(time.monotonic() - started_flood, 1)
        log_before = (work / "serve.log").stat().st_size
        loaded = timed_job(client, clip, 3, statuses, deadline)
        result["loaded"] = loaded
        health = []
        for _ in range(10):
            started = time.monotonic()
            try:
                statuses.add(client.get("/health").status_code)
                health.append(round(time.monotonic() - started, 3))
            except httpx.TransportError as err:
                statuses.add(f"transport_{type(err).__name__}")
        flood.stop.set()
        flood.join(timeout=60)
        result["flood"] = {
            "opened": dict(flood.opened),
            "closed_by_server": dict(flood.closed_by_server),
            "peak_held_by_client": flood.peak_held,
            "health_s_during": health,
            "log_growth_bytes": (work / "serve.log").stat().st_size - log_before,
        }
        checks["loaded job within 2x unloaded"] = (
            loaded["status"] == unloaded["status"] == "completed" and loaded["seconds"] <= 2 * unloaded["seconds"]
        )
        checks["job downloaded whole"] = loaded["whole"] and unloaded["whole"]

        # Never read: pipelined requests, then pipelined downloads of key A's finished job.
        key_a = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60)
        target = timed_job(key_a, clip, 6, statuses, deadline)
        key_a.close()
        auth = f"Authorization: Bearer {KEY_A}\r\n"
        cases = {
            "pipelined": (args.pipelined, f"GET /health HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode(), 20_000),
            "downloads": (
                args.downloads,
                f"GET /v1/videos/{target['id']}/content HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode(),
                2_000,
            ),
        }
        for seed, (name, (count, request, most)) in enumerate(cases.items(), start=7):
            if not count:
                continue
            case = job_beside(NeverRead(port, count, request, most, statuses), client, clip, seed, statuses, deadline)
            result[f"never_read_{name}"] = case
            checks[f"{name}: job within 3x unloaded"] = (
                case["job"]["status"] == "completed" and case["job"]["seconds"] <= 3 * unloaded["seconds"]
            )
            checks[f"{name}: /health answered within 2 s"] = (
                case["health_unanswered"] == 0 and (case["health_max_s"] or 0) <= 2
            )

        files = {"video_reference": ("huge.mp4", huge.read_bytes(), "video/mp4")}
        refused = client.post("/v1/videos", files=files, data={"sr_resolution_scale": "4"})
        statuses.add(refused.status_code)
        result["memory_probe"] = {
            "upload_bytes": huge.stat().st_size,
            "status": refused.status_code,
            "code": refused.json().get("error", {}).get("code") if refused.status_code != 200 else None,
        }
        checks["memory probe refused with a 4xx"] = 400 <= refused.status_code < 500

        # The largest job of the run: 49 tiles, accepted under the budget; the memory is sampled while it runs.
        near = timed_job(client, medium, 5, statuses, deadline)
        result["medium_job"] = near
        checks["medium job completed"] = near["status"] == "completed" and near["whole"]

        finished = timed_job(client, clip, 4, statuses, deadline)
        result["race"] = race_probe(base, finished["id"], finished["bytes"], statuses)
        checks["no download cut short"] = result["race"]["cut"] == 0
    finally:
        memory.stop.set()
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        # serve leaves its own Prefect server running (for the next start); this run's goes with its folder.
        stop_env = {**env, "K6VSR_SERVER_HOME": str(work / "store" / "prefect-server")}
        stop = [sys.executable, "-m", "entrypoints.cli", "server", "stop"]
        subprocess.run(stop, cwd=ROOT, env=stop_env, timeout=120, check=False, capture_output=True)
    result["peak_rss_mb"] = memory.peak >> 20
    result["peak_job_processes_rss_mb"] = memory.peak_jobs >> 20
    result["peak_server_fds"] = memory.peak_fds
    checks["descriptors under the open-file limit"] = memory.peak_fds < SERVER_NOFILE
    result["statuses"] = dict(statuses.counts)
    checks["memory under the budget"] = 0 < memory.peak < args.budget_mb << 20
    checks["no 500"] = not any(code.startswith("5") for code in statuses.counts)
    result["checks"] = checks
    result["log_tail"] = (work / "serve.log").read_text(errors="replace").splitlines()[-5:]
    if args.keep:
        result["work"] = str(work)
    else:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
