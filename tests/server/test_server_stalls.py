"""Connections that never read their answers, on loopback: pipelined requests and downloads whose bytes the client
never takes. Each is dropped at the send deadline, the connection cap closes them before any connection that
progresses, and the server's descriptors stay under its limit while another key is served.

The first test serves a bare ASGI app (2 KB answers) with the server's protocol in this process; the second runs
`k6vsr serve` with two keys, 16 connection places, a 3 s send deadline, 64 KB send buffers (so that a connection
that never reads stops progressing after a few downloads) and an open-file limit of 1024.
"""

from __future__ import annotations

import asyncio
import os
import random
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from http_harness import Server, completed, free_port

from entrypoints.server import serving
from entrypoints.server.auth import owners_of
from entrypoints.server.config import Connections
from entrypoints.server.serving import SETTLED_S, BoundedServer, Owners, uvicorn_config
from k6vsr_core.media.sample import make_sample_clip

KEY_A, KEY_B = "key-a-0123456789abcdef", "key-b-0123456789abcdef"
PLACES = 16  # --max-connections of both servers
ATTACKERS = 24  # never-reading connections kept open: more than the places
NOFILE = 1024


# ------------------------------------------------------------------------------------------ the attack


def stalled_connection(port: int, request: bytes, most: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection from `source` that pipelines `request` until the server stops reading it (its answers fill
    every buffer between them), at most `most` times, and never reads an answer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    pending = b""
    for _ in range(most):
        pending += request
        while pending:
            if not select.select([], [sock], [], 0.5)[1]:
                return sock  # the server has stopped reading: its answers wait for this client
            try:
                pending = pending[sock.send(pending) :]
            except BlockingIOError:
                continue
            except OSError:  # dropped already
                return sock
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed or reset `sock`, without reading what it answered."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


class Attack(threading.Thread):
    """`ATTACKERS` never-reading connections pipelining `request`, each reopened a moment after the server drops
    it, until `stop` (or `limit_s`)."""

    def __init__(self, port: int, request: bytes, most: int, limit_s: float = 120) -> None:
        super().__init__(daemon=True)
        self.port, self.request, self.most, self.limit_s = port, request, most, limit_s
        self.stop = threading.Event()
        self.opened = 0
        self.dropped = 0
        self.first_round = threading.Event()  # every attacker has stalled (or been dropped) once

    def run(self) -> None:
        rng = random.Random(7)
        sockets: list[socket.socket | None] = [None] * ATTACKERS
        reopen_at = [0.0] * ATTACKERS
        deadline = time.monotonic() + self.limit_s
        try:
            while not self.stop.is_set() and time.monotonic() < deadline:
                for index, sock in enumerate(sockets):
                    if sock is not None and closed_by_server(sock):
                        sock.close()
                        sockets[index], self.dropped = None, self.dropped + 1
                        reopen_at[index] = time.monotonic() + rng.uniform(0.2, 1.0)
                    if sockets[index] is None and time.monotonic() >= reopen_at[index]:
                        sockets[index] = stalled_connection(self.port, self.request, self.most)
                        self.opened += 1
                if self.opened >= ATTACKERS:
                    self.first_round.set()
                self.stop.wait(0.1)
        finally:
            self.first_round.set()
            for sock in sockets:
                if sock is not None:
                    sock.close()


@contextmanager
def attacking(port: int, request: bytes, most: int) -> Iterator[Attack]:
    attack = Attack(port, request, most)
    attack.start()
    try:
        assert attack.first_round.wait(60)
        yield attack
    finally:
        attack.stop.set()
        attack.join(30)


# ------------------------------------------------------------------------------------------ the protocol


HELD = threading.Event()  # set: the answers of `/hold` may go


async def two_kb(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """2 KB for any request; a path of `/slow` takes 50 ms to answer, one of `/hold` waits for `HELD`."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(0.05)
    while scope["path"] == "/hold" and not HELD.is_set():
        await asyncio.sleep(0.05)
    body = b"x" * 2048
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2048")]})
    await send({"type": "http.response.body", "body": body})


@contextmanager
def bare_server(bounds: Connections, owners: Owners | None = None) -> Iterator[tuple[int, BoundedServer]]:
    port = free_port()
    server = BoundedServer(uvicorn_config(two_kb, bounds, "127.0.0.1", port, owners=owners, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield port, server
    finally:
        server.should_exit = True
        thread.join(30)


PIPELINED = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


def test_the_cap_closes_never_reading_connections_first() -> None:
    """More connections than places pipeline requests and never read the answers: once their answers stop draining
    the cap closes the oldest of them for each new client, whose requests are answered."""
    bounds = Connections(max_connections=PLACES, header_timeout_s=1, keep_alive_s=60, send_timeout_s=600)
    with bare_server(bounds) as (port, server):
        flood = [stalled_connection(port, PIPELINED, 20_000) for _ in range(ATTACKERS)]
        try:
            assert len(server.server_state.connections) <= PLACES
            waiting = server.config.http_protocol_class.waiting  # type: ignore[attr-defined]
            deadline = time.monotonic() + 30  # until the server has sent all it can, on a busy machine
            while len(waiting) < len(server.server_state.connections) and time.monotonic() < deadline:
                time.sleep(0.1)
            for _ in range(5):
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                    assert client.get("/").status_code == 200
        finally:
            for sock in flood:
                sock.close()


def test_pipelining_clients_give_their_places_up_when_every_connection_progresses() -> None:
    """More connections than places pipeline slow requests: none stops progressing (their answers are small, and
    slow to come), so the cap closes the one answered most often in a row for each new client, whose request is
    answered, and a client that asks again on its keep-alive connection keeps it."""
    bounds = Connections(max_connections=PLACES, header_timeout_s=1, keep_alive_s=60, send_timeout_s=600)
    with bare_server(bounds) as (port, server):
        flood = [stalled_connection(port, b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n", 1000) for _ in range(ATTACKERS)]
        try:
            time.sleep(0.5)  # each open connection answered a few times
            assert len(server.server_state.connections) <= PLACES
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                for _ in range(5):  # one keep-alive connection that asks, waits for the answer and asks again
                    assert client.get("/slow").status_code == 200
        finally:
            for sock in flood:
                sock.close()


def answered(sock: socket.socket, request: bytes) -> bool:
    """Whether `request` sent on `sock` gets the bare app's whole answer (a head and 2 KB)."""
    try:
        sock.sendall(request)
        received = b""
        while b"\r\n\r\n" not in received or len(received.partition(b"\r\n\r\n")[2]) < 2048:
            chunk = sock.recv(65536)
            if not chunk:
                return False
            received += chunk
    except OSError:  # reset
        return False
    return received.startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize(
    ("attacker", "client", "header"),
    [
        # Keys: both from one address, the attacker with key A, the client with key B.
        ("127.0.0.1", "127.0.0.1", f"Authorization: Bearer {KEY_A}\r\n"),
        # Addresses: keyless, from two loopback addresses (a made-up key counts as no key).
        ("127.0.0.2", "127.0.0.3", "Authorization: Bearer made-up-key\r\n"),
    ],
    ids=["keys", "addresses"],
)
def test_one_holders_flood_takes_no_place_of_another_key_or_address(attacker: str, client: str, header: str) -> None:
    """A client's keep-alive connection, idle between two requests, is the longest waiting one when another key
    (or address) floods the server with more never-reading connections than it has places: the flood gives its own
    places up and the client's second request is answered on the same connection."""
    bounds = Connections(max_connections=PLACES, header_timeout_s=60, keep_alive_s=60, send_timeout_s=600)
    owners = owners_of([KEY_A, KEY_B])
    own_request = b"GET / HTTP/1.1\r\nHost: x\r\n" + (
        f"Authorization: Bearer {KEY_B}\r\n\r\n".encode() if "made-up" not in header else b"\r\n"
    )
    with bare_server(bounds, owners) as (port, server):
        own = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(client, 0))
        flood: list[socket.socket] = []
        try:
            assert answered(own, own_request)
            waiting = server.config.http_protocol_class.waiting  # type: ignore[attr-defined]
            deadline = time.monotonic() + 30
            while not waiting and time.monotonic() < deadline:  # the client's connection waits for its next head
                time.sleep(0.05)
            time.sleep(SETTLED_S + 0.2)  # and has waited long enough to be the first one given up by place
            request = f"GET / HTTP/1.1\r\nHost: x\r\n{header}\r\n".encode()
            flood = [stalled_connection(port, request, 20_000, attacker) for _ in range(ATTACKERS)]
            assert len(server.server_state.connections) <= PLACES
            assert answered(own, own_request)
        finally:
            own.close()
            for sock in flood:
                sock.close()


def test_a_key_past_its_share_of_busy_connections_gives_one_up_to_another_key() -> None:
    """One key holds every place with a request each that takes long to answer (none waits, none pipelines): past
    its share, it gives one of them up to another key's new connection, whose request is answered."""
    bounds = Connections(max_connections=PLACES, header_timeout_s=60, keep_alive_s=60, send_timeout_s=600)
    HELD.clear()
    with bare_server(bounds, owners_of([KEY_A, KEY_B])) as (port, server):
        held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(PLACES)]
        try:
            for sock in held:
                sock.sendall(f"GET /hold HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n\r\n".encode())
            waiting = server.config.http_protocol_class.waiting  # type: ignore[attr-defined]
            deadline = time.monotonic() + 30
            while (waiting or len(server.server_state.connections) < PLACES) and time.monotonic() < deadline:
                time.sleep(0.05)  # every head read: each connection is busy with its request
            assert not waiting and len(server.server_state.connections) == PLACES
            with socket.create_connection(("127.0.0.1", port), timeout=30) as own:
                assert answered(own, f"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_B}\r\n\r\n".encode())
            assert sum(closed_by_server(sock) for sock in held) == 1
        finally:
            HELD.set()
            for sock in held:
                sock.close()


def test_a_new_connection_takes_no_place_of_one_just_opened_beside_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections of one address that have not sent their request head yet (none for long: a burst of new
    clients, the check among them) fill the places: the next one past the cap is closed, not one of them, which
    would be no more to give up than it."""
    monkeypatch.setattr(serving, "SETTLED_S", 600.0)  # every head is awaited for less, however busy the machine
    bounds = Connections(max_connections=PLACES, header_timeout_s=60, keep_alive_s=60, send_timeout_s=600)
    with bare_server(bounds) as (port, server):
        first = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(PLACES)]
        try:
            deadline = time.monotonic() + 30
            while len(server.server_state.connections) < PLACES and time.monotonic() < deadline:
                time.sleep(0.05)
            with socket.create_connection(("127.0.0.1", port), timeout=30) as newcomer:
                assert newcomer.recv(1) == b""  # closed by the server
            for sock in first:
                assert answered(sock, PIPELINED)
        finally:
            for sock in first:
                sock.close()


def test_a_new_connection_whose_head_names_a_key_holds_its_place_for_that_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections of one address that have not sent a request head (none for long) fill the places: a new one from
    that address whose head names another key is that key's, so it takes one of theirs rather than being closed as
    one more of them, whether its head is in the socket as the server accepts it or comes a moment later."""
    monkeypatch.setattr(serving, "SETTLED_S", 600.0)  # every head is awaited for less, however busy the machine
    bounds = Connections(max_connections=PLACES, header_timeout_s=60, keep_alive_s=60, send_timeout_s=600)
    request = f"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_B}\r\n\r\n".encode()
    with bare_server(bounds, owners_of([KEY_A, KEY_B])) as (port, server):
        quiet = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(PLACES)]
        try:
            deadline = time.monotonic() + 30
            while len(server.server_state.connections) < PLACES and time.monotonic() < deadline:
                time.sleep(0.05)
            for pause in (0.0, 0.2):  # its head with its connection; then after the server has accepted it
                with socket.create_connection(("127.0.0.1", port), timeout=30) as newcomer:
                    time.sleep(pause)
                    assert answered(newcomer, request), f"closed as one of its address's (head after {pause} s)"
            assert len(server.server_state.connections) <= PLACES
            assert 1 <= sum(closed_by_server(sock) for sock in quiet) <= 2  # a place given up (the first's is free)
        finally:
            for sock in quiet:
                sock.close()


def test_new_connections_past_the_cap_that_send_nothing_cost_a_bounded_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the cap, connections whose heads do not come are each given `PLACE_WAIT_S` to name a key, at most
    `UNPLACED_MOST` at once, then closed; the places stay with the connections that held them (of their address,
    just opened: no more to give up than they)."""
    monkeypatch.setattr(serving, "SETTLED_S", 600.0)  # every head is awaited for less, however busy the machine
    bounds = Connections(max_connections=PLACES, header_timeout_s=60, keep_alive_s=60, send_timeout_s=600)
    with bare_server(bounds, owners_of([KEY_A, KEY_B])) as (port, server):
        held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(PLACES)]
        extra: list[socket.socket] = []
        try:
            deadline = time.monotonic() + 30
            while len(server.server_state.connections) < PLACES and time.monotonic() < deadline:
                time.sleep(0.05)
            extra = [
                socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(serving.UNPLACED_MOST + 8)
            ]
            open_now = [c for c in server.server_state.connections if not c.transport.is_closing()]  # type: ignore[attr-defined]
            assert len(open_now) <= PLACES + serving.UNPLACED_MOST  # (one being closed may not be gone yet)
            deadline = time.monotonic() + 30
            while not all(closed_by_server(sock) for sock in extra) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert all(closed_by_server(sock) for sock in extra)
            assert not any(closed_by_server(sock) for sock in held)
        finally:
            for sock in held + extra:
                sock.close()


def test_the_send_deadline_drops_never_reading_connections() -> None:
    """Connections whose answers stop draining are dropped at the send deadline: the server holds none of them."""
    bounds = Connections(max_connections=PLACES, header_timeout_s=1, keep_alive_s=60, send_timeout_s=1)
    with bare_server(bounds) as (port, server):
        flood = [stalled_connection(port, PIPELINED, 20_000) for _ in range(4)]
        try:
            deadline = time.monotonic() + 30  # the 1 s send deadline, on a busy machine
            while server.server_state.connections and time.monotonic() < deadline:
                time.sleep(0.2)
            # The server holds none of them; whether a client sees the drop depends on where its unread answers
            # were at the deadline (asyncio's buffer: a reset; the kernel's: a close queued behind them).
            assert not server.server_state.connections
        finally:
            for sock in flood:
                sock.close()


# ------------------------------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_bundle_path: Path, prefect_server: str) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stalls")
    allowed = root / "allowed"
    allowed.mkdir()
    make_sample_clip(allowed / "square.mp4", width=64, height=64, num_frames=1, audio=False)
    return {"root": root, "allowed": allowed, "store": root / "store", "bundle": tiny_bundle_path}


@pytest.fixture(scope="module")
def server(stack: dict[str, Path]) -> Iterator[Server]:
    args = ["--allow-path", str(stack["allowed"]), "--api-key", KEY_A, "--api-key", KEY_B]
    args += ["--max-connections", str(PLACES), "--send-timeout-s", "3", "--send-buffer-kb", "64"]
    args += ["--header-timeout-s", "1", "--keep-alive-s", "1"]
    running = Server(stack["root"], stack["store"], stack["bundle"], "stalls", args, KEY_A, nofile=NOFILE).start()
    yield running
    running.stop()


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def server_connections(pid: int, port: int) -> int:
    """The established connections the server process holds on its port."""
    return sum(
        1
        for connection in psutil.Process(pid).net_connections(kind="tcp")
        if connection.status == psutil.CONN_ESTABLISHED and connection.laddr and connection.laddr.port == port
    )


def test_never_read_downloads_leave_places_and_descriptors(server: Server, stack: dict[str, Path]) -> None:
    """Key A's connections pipeline downloads of its output and never read them, more of them than the server has
    places, reopened as they are dropped. Meanwhile `/health` answers every time, key B's job is taken, computed and
    downloaded, nothing is answered 5xx, and the server's descriptors stay under its open-file limit."""
    clip = str(stack["allowed"] / "square.mp4")
    done = completed(server, server.post_json(video_path=clip, sr_resolution_scale=2, seed=21))
    auth = f"Authorization: Bearer {KEY_A}\r\n"
    download = f"GET /v1/videos/{done['id']}/content HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode()
    assert server.process is not None
    pid = server.process.pid
    with attacking(server.port, download, 2000) as attack:
        peak = descriptors(pid)
        with server.as_key(KEY_B) as other:
            posted = other.post("/v1/videos", json={"video_path": clip, "sr_resolution_scale": 2, "seed": 22})
            assert posted.status_code == 200, posted.text
            job = posted.json()
            while job["status"] not in ("completed", "failed", "cancelled"):
                with httpx.Client(base_url=server.client.base_url, timeout=10) as probe:
                    assert probe.get("/health", headers={"Authorization": f"Bearer {KEY_B}"}).status_code == 200
                with server.as_key(KEY_B) as poll:
                    job = poll.get(f"/v1/videos/{job['id']}").json()
                peak = max(peak, descriptors(pid))
                time.sleep(0.3)
            assert job["status"] == "completed", job
            with server.as_key(KEY_B) as fetch:
                content = fetch.get(f"/v1/videos/{job['id']}/content")
            assert content.status_code == 200 and len(content.content) == job["output"]["bytes"]
        # More attackers than places, all still open on their side: the server holds no more connections than its
        # places. (The client cannot always tell it was dropped: a close the server sends waits behind answers the
        # client never reads, and the kernel's user timeout drops the connection without a word.)
        assert attack.opened >= ATTACKERS
        held = server_connections(pid, server.port)
        assert held <= PLACES, f"the server holds {held} connections for {PLACES} places"
    assert peak < NOFILE
    log = server.log_path.read_text(errors="replace")
    for sign in ("Too many open files", "Exception in ASGI", '" 500', '" 503'):
        assert sign not in log, server.log()
    assert server.client.get("/health").status_code == 200
