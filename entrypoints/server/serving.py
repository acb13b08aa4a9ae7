"""Serving the app with uvicorn, within bounds on connections: how many are open, and how long one may take to send
a request's head, stay idle, or leave its answer untaken.

uvicorn bounds an idle keep-alive connection (`timeout_keep_alive`) and the size of a request head (h11's
`max_incomplete_event_size`), and both are used. It has no deadline for a request head, none for a client to take
its answer, and no cap on open connections: a connection that never finishes its headers, or that pipelines requests
(or downloads) and never reads, stays open for good, and enough of them exhaust the process's file descriptors (then
every accept fails, and so does every file the server opens, job records included). Its `limit_concurrency` counts
such idle connections too and answers 503 to every real request once they fill it, so it is not used.
`BoundedH11Protocol` adds the missing bounds to uvicorn's own h11 protocol:

- a request head must arrive within `header_timeout_s` of the connection opening (or of the previous answer, after
  the keep-alive time), else the connection is closed;
- an answer's bytes that wait for the client (asyncio pauses the protocol's writing) must all be taken within
  `send_timeout_s`, else the connection is dropped: each pause is a deadline, so a client that reads keeps its
  connection and one that never reads loses it. The kernel holds the same bound on unacknowledged bytes
  (`TCP_USER_TIMEOUT`);
- at most `max_connections` are open, shared by their holders: a connection is held by the API key of its last request
  (a key the server has; `owners`; a first request's head already in the socket is looked at as it opens), else by
  its client's address. A new connection past the cap takes its place from
  the holder with the most open connections: the one of them that has been waiting the longest, for a request head or
  for its client to take its answer (for a second at least); else the one answered most often in a row without waiting
  for a request head (a client pipelining requests, which progresses as long as the server has time for it); else one
  waiting for less (of the newcomer's own holder, only one whose answer is not draining or idle after an answer: one
  just opened waits for its head too, and is no more to give up than the newcomer); else, if it holds more than its
  share of the places (the cap divided by the holders), the one of its busy connections answered most often in a row
  (cut mid-answer). A holder
  with none of these gives nothing up and the next largest is asked, down to the newcomer's own holder: the newcomer
  is closed rather than take a place from a holder with fewer connections than its own. A newcomer whose head was not
  in the socket as it opened counts as its address's until its head comes: it is given `PLACE_WAIT_S` for it (at
  most `UNPLACED_MOST` such at once), and placed for the key it names, or closed. So a flood of idle,
  half-open, pipelining or never-reading connections, of one key or one address, costs the other keys and addresses
  nothing, a busy client of its own holder nothing but its turn, and the number of file descriptors the connections
  take stays under the process's limit (`fit_connections`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import resource
import socket
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from entrypoints.server.config import Connections

log = logging.getLogger("k6vsr.server")

# Connections accepted in one go (uvicorn's `backlog`: the listen queue, and asyncio's accept batch). A batch is
# accepted on every turn of the event loop, and takes about three turns to reach the cap below and another to be
# closed: that many batches may be open beside the capped connections.
ACCEPT_BATCH = 128
# Seconds a stop waits for the requests in flight.
GRACEFUL_SHUTDOWN_S = 10
# File descriptors one connection may hold: its socket, and the file its request streams into (an upload) or its
# answer is read from (a download); h11 serves one request of a connection at a time.
FDS_PER_CONNECTION = 2
# File descriptors kept for everything but connections: the accept batches in flight, and job records, the copies
# of `video_path` files (a worker thread each), pipes and the Prefect client.
RESERVED_FDS = 4 * ACCEPT_BATCH + 128
# Accept errors (the process or the system out of descriptors or memory): asyncio retries the accept a second later
# and reports each failure; they are logged one line at most this often, without a traceback, whose source lines
# could not be read without descriptors either.
ACCEPT_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_ERROR_LOG_S = 10.0
# A request head's `Authorization` header, whose value names who holds the connection.
AUTHORIZATION = re.compile(rb"\r\nauthorization:[ \t]*([^\r\n]*)", re.IGNORECASE)
# Who holds a connection, from its request's `Authorization` header: the owner of one of the server's keys, else None.
Owners = Callable[[bytes], "str | None"]
# Seconds a connection has been waiting (for a request head, or for its client to take its answer) before the cap
# takes its place ahead of a pipelining connection's.
SETTLED_S = 1.0
# A new connection past the cap whose request head was not in the socket as it opened: how long its head is awaited
# to learn whose it is, and how many such connections wait at once (more are closed at once: a flood of connections
# that send nothing costs this many descriptors beyond the cap, for this long).
PLACE_WAIT_S = 0.5
UNPLACED_MOST = 32


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head and for each answer's bytes to be taken, and a
    cap on open connections. `bounds`, `owners` and `waiting` are set per server by `protocol_for`."""

    bounds: Connections
    owners: Owners
    # Connections that are not progressing: waiting for a request head, or their answer's bytes waiting for their
    # client; the one that stopped progressing first comes first, with the loop's time it stopped.
    waiting: OrderedDict[BoundedH11Protocol, float]
    # New connections past the cap that have no place yet, their heads awaited (`PLACE_WAIT_S`), with the refusal.
    unplaced: dict[BoundedH11Protocol, asyncio.TimerHandle]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._send_deadline: asyncio.TimerHandle | None = None
        self._idle_cycle: object = None  # the request cycle current when this connection last became idle
        self._idle = False  # waiting for a request head
        self._stalled = False  # bytes of its answer wait for the client to read
        self._in_a_row = 0  # requests answered since it last waited for a request head: pipelined ones
        self._answered = False  # it has had an answer: no longer a connection just opened
        self._holder = ""  # who holds its place: a key's owner, else its client's address (`_hold`)
        self._held_cycle: object = None  # the request cycle whose head last set `_holder`
        self._peeked: bytes | None = None  # its first request head, whole, if it was in the socket as it opened

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._holder = self._first_holder(transport)
        # Writing pauses as soon as a byte waits for the client (asyncio's default waits for 64 KB): a pause is
        # then exactly "the client is not taking the answer", and each one gets the send deadline.
        transport.set_write_buffer_limits(high=0)
        bound_unacknowledged(transport, self.bounds.send_timeout_s, self.bounds.send_buffer_bytes)
        if len(self.connections) > self.bounds.max_connections:
            if (given_up := self._place_to_take()) is not None:
                given_up._close()
            elif self._peeked is None and len(self.unplaced) < UNPLACED_MOST:
                # Its head was not in the socket yet, so it counts as its address's, which has no place for it: it
                # may name a key that has. Its first bytes are held back until its head is whole, within a moment.
                self.unplaced[self] = self.loop.call_later(PLACE_WAIT_S, self._refuse)
                self._peeked = b""
                return
            else:  # no holder with more connections than its own gives one up: this one waits for none of them
                self.transport.close()
                return
        self._wait_for_head(self.bounds.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self in self.unplaced:
            self._peeked = (self._peeked or b"") + data
            if b"\r\n\r\n" not in self._peeked and len(self._peeked) < self.bounds.max_header_bytes:
                return
            self.unplaced.pop(self).cancel()
            self._holder = self._holder_of(self._peeked)
            if (given_up := self._place_to_take()) is None:
                self.transport.close()
                return
            given_up._close()
            self._wait_for_head(self.bounds.header_timeout_s)
            data, self._peeked = self._peeked, None
        super().data_received(data)
        if self.cycle is not self._idle_cycle:  # a request head arrived: the connection is busy
            self._stop_waiting_for_head()
        if self.cycle is not None and self.cycle is not self._held_cycle:
            self._hold(self.cycle.scope["headers"])

    def _first_holder(self, transport: asyncio.Transport) -> str:
        """Who holds a new connection: the key its first request names, where that request's head already waits in
        the socket (looked at, not taken: h11 reads it as ever), else its client's address. A flood's new
        connections are then its key's from the start, not every client's of their address."""
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                with socket.socket(fileno=os.dup(sock.fileno())) as same:
                    waiting = same.recv(self.bounds.max_header_bytes, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                    self._peeked = waiting if b"\r\n\r\n" in waiting else None
            except OSError:  # nothing there yet, or no descriptor to spare
                pass
        return self._holder_of(self._peeked or b"")

    def _holder_of(self, waiting: bytes) -> str:
        """The key's owner a whole request head names, else the client's address."""
        head = waiting.partition(b"\r\n\r\n")[0] if b"\r\n\r\n" in waiting else b""
        header = AUTHORIZATION.search(head)
        owner = self.owners(header.group(1).strip()) if header else None
        return owner if owner is not None else f"address {self.client[0] if self.client else ''}"

    def _refuse(self) -> None:
        """Its head did not come whole in time: it had no place, and is closed."""
        self.unplaced.pop(self, None)
        self.transport.close()

    def _hold(self, headers: Iterable[tuple[bytes, bytes]]) -> None:
        """The connection is held by the key its request names, if the server has it: a made-up key counts as
        its address, so that no client makes itself many holders."""
        self._held_cycle = self.cycle
        owner = self.owners(next((value for name, value in headers if name == b"authorization"), b""))
        if owner is not None:
            self._holder = owner

    def on_response_complete(self) -> None:
        self._in_a_row += 1
        self._answered = True
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            # Idle again: uvicorn closes it after the keep-alive time unless data comes; a head begun then must
            # still be complete within the header timeout.
            self._wait_for_head(self.bounds.keep_alive_s + self.bounds.header_timeout_s)

    def pause_writing(self) -> None:
        super().pause_writing()
        if not self._stalled:
            self._stalled = True
            self._send_deadline = self.loop.call_later(self.bounds.send_timeout_s, self._close)
            self._note_progress()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_stalling()

    def connection_lost(self, exc: Exception | None) -> None:
        if (refusal := self.unplaced.pop(self, None)) is not None:
            refusal.cancel()
        self._stop_waiting_for_head()
        self._stop_stalling()
        super().connection_lost(exc)

    def _wait_for_head(self, within_s: float) -> None:
        self._stop_waiting_for_head()
        self._idle_cycle = self.cycle
        self._idle = True
        self._in_a_row = 0
        self._head_deadline = self.loop.call_later(within_s, self._close)
        self._note_progress()

    def _stop_waiting_for_head(self) -> None:
        self._idle = False
        _cancel(self._head_deadline)
        self._head_deadline = None
        self._note_progress()

    def _stop_stalling(self) -> None:
        self._stalled = False
        _cancel(self._send_deadline)
        self._send_deadline = None
        self._note_progress()

    def _note_progress(self) -> None:
        if not (self._idle or self._stalled):
            self.waiting.pop(self, None)
        elif self not in self.waiting:  # it stopped progressing now: last in line to be closed
            self.waiting[self] = self.loop.time()

    def _place_to_take(self) -> BoundedH11Protocol | None:
        """The connection a new one past the cap closes: one of the holder with the most open connections that
        gives one up (`_given_up_among`, or any of its busy ones past its share), down to this connection's own
        holder; None when none does."""
        holders: defaultdict[str, set[BoundedH11Protocol]] = defaultdict(set)
        for other in self.connections:  # every connection of this server is a BoundedH11Protocol
            if isinstance(other, BoundedH11Protocol) and not other.transport.is_closing():  # closed: gone already
                holders[other._holder].add(other)
        share = self.bounds.max_connections // len(holders)
        for holder, held in sorted(holders.items(), key=lambda item: len(item[1]), reverse=True):
            others = held - {self}
            if (given_up := self._given_up_among(others, own=holder == self._holder)) is not None:
                return given_up
            if holder == self._holder:
                return None
            if len(held) > share:  # past its share, a holder gives up one of its busy connections too
                return max(others, key=lambda other: other._in_a_row)
        return None

    def _given_up_among(self, held: set[BoundedH11Protocol], own: bool) -> BoundedH11Protocol | None:
        """Of `held`, the one waiting longest, if for `SETTLED_S` at least (a download whose client reads pauses
        too, each time for a moment); else the most pipelining one; else one waiting for less: its answer not
        draining, idle after an answer, or, of another holder's (`own` False), waiting for its first request head:
        one of the newcomer's own holder just opened is no more to give up than the newcomer itself."""
        oldest = next(((other, since) for other, since in self.waiting.items() if other in held), None)
        if oldest is not None and self.loop.time() - oldest[1] >= SETTLED_S:
            return oldest[0]
        if (pipelining := self._most_pipelined(held)) is not None:
            return pipelining
        return next(
            (other for other in self.waiting if other in held and (other._stalled or other._answered or not own)), None
        )

    @staticmethod
    def _most_pipelined(held: set[BoundedH11Protocol]) -> BoundedH11Protocol | None:
        """The connection answered most often in a row without waiting for a request head, if more than once: a
        client that pipelines requests keeps its connection progressing for as long as the server has time for it,
        and gives its place up first (one that asks, waits for the answer and asks again never has more than one)."""
        busiest = max(held, key=lambda other: other._in_a_row, default=None)
        return busiest if busiest is not None and busiest._in_a_row > 1 else None

    def _close(self) -> None:
        self._stop_waiting_for_head()
        self._stop_stalling()
        if self.transport.get_write_buffer_size():
            # Bytes its client never took: `close` would wait for them for good, holding the socket.
            self.transport.abort()
        elif not self.transport.is_closing():
            self.transport.close()


def bound_unacknowledged(transport: asyncio.BaseTransport, seconds: float, send_buffer: int | None) -> None:
    """The kernel drops the connection when bytes it sent stay unacknowledged, or its client's receive window stays
    shut, for `seconds` (`TCP_USER_TIMEOUT`; Linux). It bounds what asyncio's buffer no longer holds: the bytes
    already in the socket's send buffer, which `send_buffer` caps (`SO_SNDBUF`) where given. `SO_SNDTIMEO` is no use
    here: it bounds blocking sends only."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    options = [(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)] if send_buffer else []
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        options.append((socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(seconds * 1000))))
    for level, option, value in options:
        try:
            sock.setsockopt(level, option, value)
        except OSError:  # a kernel without it: the send deadline above still holds
            pass


def protocol_for(bounds: Connections, owners: Owners | None = None) -> type[BoundedH11Protocol]:
    """The protocol class of one server: its bounds, who holds its connections (`owners`; None: a server without
    keys, where connections are held by their addresses), and its own table of waiting connections."""
    attributes = {
        "bounds": bounds,
        "owners": staticmethod(owners or no_owner),
        "waiting": OrderedDict(),
        "unplaced": {},
    }
    return type("BoundedH11Protocol", (BoundedH11Protocol,), attributes)


def no_owner(_: bytes) -> None:
    return None


class AcceptErrorLog:
    """The event loop's exception handler: accept errors as one line each `ACCEPT_ERROR_LOG_S` with their count,
    everything else as asyncio logs it."""

    def __init__(self) -> None:
        self.unlogged = 0
        self.logged_at = -ACCEPT_ERROR_LOG_S

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if not (isinstance(exc, OSError) and exc.errno in ACCEPT_ERRORS and "accept" in context.get("message", "")):
            loop.default_exception_handler(context)
            return
        self.unlogged += 1
        now = time.monotonic()
        if now - self.logged_at >= ACCEPT_ERROR_LOG_S:
            log.warning(
                "accepting connections failed %d time(s) (%s): retried each second",
                self.unlogged,
                errno.errorcode.get(exc.errno or 0, exc.errno),
            )
            self.unlogged, self.logged_at = 0, now


class BoundedServer(uvicorn.Server):
    """uvicorn's server with `AcceptErrorLog` as its event loop's exception handler."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
        await super().startup(sockets)


def fit_connections(bounds: Connections) -> Connections:
    """`bounds` with `max_connections` lowered to what the open-file limit leaves after `RESERVED_FDS`, each
    connection counted with `FDS_PER_CONNECTION`. The soft limit is raised to the hard one first, as far as the
    connections need."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = bounds.max_connections * FDS_PER_CONNECTION + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return bounds
    fitted = max(16, (int(soft) - RESERVED_FDS) // FDS_PER_CONNECTION)
    log.warning(
        "--max-connections %d lowered to %d: the open-file limit is %d (ulimit -n), a connection takes up to %d "
        "and %d are kept for files",
        bounds.max_connections,
        fitted,
        soft,
        FDS_PER_CONNECTION,
        RESERVED_FDS,
    )
    return replace(bounds, max_connections=fitted)


def uvicorn_config(
    app: Any, bounds: Connections, host: str, port: int, owners: Owners | None = None, **options: Any
) -> uvicorn.Config:
    """uvicorn's configuration for `app` under `bounds` (as given: `fit_connections` is the caller's), its
    connections held by `owners` (see `protocol_for`)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol_for(bounds, owners),
        timeout_keep_alive=bounds.keep_alive_s,  # type: ignore[arg-type]  # a float works: it is a call_later delay
        h11_max_incomplete_event_size=bounds.max_header_bytes,
        backlog=ACCEPT_BATCH,
        # A stop (SIGTERM, Ctrl-C) waits this long for requests in flight (a slow upload may take
        # --upload-timeout-s), then cancels them: the job processes are stopped, and their runs marked, promptly.
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        server_header=False,
        **options,
    )


def _cancel(deadline: asyncio.TimerHandle | None) -> None:
    if deadline is not None:
        deadline.cancel()
