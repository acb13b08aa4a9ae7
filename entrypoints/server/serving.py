"""Serving the app with uvicorn, within bounds on connections: how many are open, how long one may take to send a
request's head, how long an idle one stays.

uvicorn bounds an idle keep-alive connection (`timeout_keep_alive`) and the size of a request head (h11's
`max_incomplete_event_size`), and both are used. It has no deadline for a request head and no cap on open
connections: a connection that never finishes its headers stays open for good, and enough of them exhaust the
process's file descriptors (then every accept fails, and so does every file the server opens, job records
included). Its `limit_concurrency` counts such idle connections too and answers 503 to every real request once they
fill it, so it is not used. `BoundedH11Protocol` adds the two missing bounds to uvicorn's own h11 protocol:

- a request head must arrive within `header_timeout_s` of the connection opening (or of the previous answer, after
  the keep-alive time), else the connection is closed;
- at most `max_connections` are open; a new one past that closes the connection that has been idle (waiting for a
  request head) the longest, and is itself closed at once only when every other connection is busy with a request.
  So a flood of idle or half-open connections costs a busy client nothing but its turn, and the number of file
  descriptors the connections take stays under the process's limit (`fit_connections`).
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import OrderedDict
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
# File descriptors kept for everything but connections: the accept batches in flight, and job records, uploads,
# outputs, pipes and the Prefect client.
RESERVED_FDS = 4 * ACCEPT_BATCH + 128


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head and a cap on open connections. `bounds` and
    `idle` are set per server by `protocol_for`."""

    bounds: Connections
    idle: OrderedDict[BoundedH11Protocol, None]  # connections waiting for a request head, longest waiting first

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._idle_cycle: object = None  # the request cycle current when this connection last became idle

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.bounds.max_connections:
            if self.idle:
                oldest = next(iter(self.idle))
                oldest._close()
            else:  # every other connection is serving a request: this one waits for none of them
                self.transport.close()
                return
        self._wait_for_head(self.bounds.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not self._idle_cycle:  # a request head arrived: the connection is busy
            self._busy()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            # Idle again: uvicorn closes it after the keep-alive time unless data comes; a head begun then must
            # still be complete within the header timeout.
            self._wait_for_head(self.bounds.keep_alive_s + self.bounds.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._busy()
        super().connection_lost(exc)

    def _wait_for_head(self, within_s: float) -> None:
        self._busy()
        self._idle_cycle = self.cycle
        self.idle[self] = None
        self._head_deadline = self.loop.call_later(within_s, self._close)

    def _busy(self) -> None:
        self.idle.pop(self, None)
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _close(self) -> None:
        self._busy()
        if not self.transport.is_closing():
            self.transport.close()


def protocol_for(bounds: Connections) -> type[BoundedH11Protocol]:
    """The protocol class of one server: its bounds, and its own table of idle connections."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"bounds": bounds, "idle": OrderedDict()})


def fit_connections(bounds: Connections) -> Connections:
    """`bounds` with `max_connections` lowered to what the open-file limit leaves after `RESERVED_FDS`. The soft
    limit is raised to the hard one first, as far as the connections need."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = bounds.max_connections + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return bounds
    fitted = max(16, int(soft) - RESERVED_FDS)
    log.warning(
        "--max-connections %d lowered to %d: the open-file limit is %d (ulimit -n), and %d are kept for files",
        bounds.max_connections,
        fitted,
        soft,
        RESERVED_FDS,
    )
    return Connections(
        max_connections=fitted,
        header_timeout_s=bounds.header_timeout_s,
        keep_alive_s=bounds.keep_alive_s,
        max_header_bytes=bounds.max_header_bytes,
    )


def uvicorn_config(app: Any, bounds: Connections, host: str, port: int, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for `app` under `bounds` (as given: `fit_connections` is the caller's)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol_for(bounds),
        timeout_keep_alive=bounds.keep_alive_s,  # type: ignore[arg-type]  # a float works: it is a call_later delay
        h11_max_incomplete_event_size=bounds.max_header_bytes,
        backlog=ACCEPT_BATCH,
        # A stop (SIGTERM, Ctrl-C) waits this long for requests in flight (a slow upload may take
        # --upload-timeout-s), then cancels them: the job processes are stopped, and their runs marked, promptly.
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        server_header=False,
        **options,
    )
