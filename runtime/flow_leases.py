"""Flow-run leases: which process on this host runs which flow run, so that a run whose process died is ended.

A flow run holds a lease (`leased`) from the start of its body until the API has its final state (`LEASE_HOOKS`, the
flow's state hooks, which Prefect calls only once the server took that state): a file in the local server's state
folder (`runtime.prefect_server`, `leases/`) naming the process (pid and start time) and the API the run reports to.
A run whose end never reached the API keeps it: its server went away, or its process was killed outright (SIGKILL,
OOM), and the run would show "Running" forever. The next command that reaches the API finds the lease's process
dead and marks the run Crashed, with its task runs that were in flight (`mark_crashed_runs`). A command stopped by
Ctrl-C leaves a helper that marks its runs Cancelled as soon as it is gone (`end_leased_runs`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import socket
import time
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypedDict, TypeVar

from pydantic import BaseModel

from runtime import interrupts
from runtime.prefect_server import ServerRecord, server_auth, server_folder
from runtime.state_folder import StateFolder, now
from storage.processes import alive, process_start
from storage.records import atomic_write_bytes

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun
    from prefect.flows import FlowStateHook
    from prefect.states import State

log = logging.getLogger("k6vsr.prefect_server")

LEASE_MAX_AGE_S = 30 * 24 * 3600  # a lease whose API was never current again is dropped after this

P = ParamSpec("P")
R = TypeVar("R")


class Lease(BaseModel):
    flow_run_id: str
    pid: int
    host: str
    api_url: str | None
    api: str | None = None  # which history the run is in (`_api_identity`): the local server keeps its across ports
    started_at: str
    process_start: int | None = None


def _leases(folder: StateFolder) -> Path:
    return folder.path / "leases"


def take_lease(flow_run_id: str) -> None:
    """Name this process as the one running `flow_run_id`, until the API has the run's final state.

    The lease outlives the body whatever its end: Prefect reports that end next, and the report may never land (the
    server killed meanwhile; an interrupt, where Prefect first waits for the tasks in flight and a SIGKILL may cut it
    short). The state hooks drop it once the server has the final state; otherwise the run is marked Crashed once
    this process is gone, by whoever looks first (`mark_crashed_runs`; a final run is left as it is).
    """
    from prefect.settings import PREFECT_API_URL

    folder = server_folder()
    path = _leases(folder) / f"{flow_run_id}.json"
    api_url = PREFECT_API_URL.value() or None
    lease = Lease(
        flow_run_id=str(flow_run_id),
        pid=os.getpid(),
        host=socket.gethostname(),
        api_url=api_url,
        api=_api_identity(api_url, folder) if api_url else None,
        started_at=now(),
        process_start=process_start(os.getpid()),
    )
    try:
        folder.make()
        atomic_write_bytes(path, lease.model_dump_json().encode())
    except OSError as err:  # a lease only helps the next command: never fail a run over it
        log.warning("could not write the flow run lease %s: %s", path, err)


def _lease_reached_the_api(flow: object, flow_run: FlowRun, state: State) -> None:
    """A flow's state hook: its run's final state is on the API (Prefect calls hooks after the server took the
    state), so its lease has done its job."""
    path = _leases(server_folder()) / f"{flow_run.id}.json"
    with contextlib.suppress(OSError, ValueError):
        if Lease.model_validate_json(path.read_bytes()).pid == os.getpid():
            path.unlink(missing_ok=True)


class LeaseHooks(TypedDict):
    on_completion: list[FlowStateHook[..., Any]]
    on_failure: list[FlowStateHook[..., Any]]
    on_crashed: list[FlowStateHook[..., Any]]


# Every leased flow is declared with these (`@flow(..., **LEASE_HOOKS)`), or its leases would stay until the next
# command reads each run's state; `leased` refuses a flow without them.
LEASE_HOOKS = LeaseHooks(
    on_completion=[_lease_reached_the_api], on_failure=[_lease_reached_the_api], on_crashed=[_lease_reached_the_api]
)


# Kept beside Prefect's flow heartbeats: those are events sent every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (30 at
# the least, prefect 3.9), and a run whose heartbeats stop is marked Crashed only by an automation someone created on
# the server. A lease names the process itself (pid and start time), so the next command on this host knows at once,
# on any Prefect API, even one that is not ours to configure, that the run's process is gone.
def leased(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate a flow's function (below `@flow`) so its run holds a lease while its body runs."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        from prefect.context import FlowRunContext
        from prefect.runtime import flow_run

        context = FlowRunContext.get()
        running = context.flow if context is not None else None
        if running is not None and _lease_reached_the_api not in running.on_completion_hooks:
            raise TypeError(f"flow {running.name!r} is leased but not declared with **LEASE_HOOKS")
        if flow_run.id:
            take_lease(flow_run.id)
        with interrupts.noting_signals():
            try:
                return fn(*args, **kwargs)
            except BaseException as exc:
                interrupts.surfaced(exc)  # a command stops here, its lease still held (`end_leased_runs`)
                raise

    # Prefect reads the parameters' types from the function it is given, resolving names in that function's module:
    # hand it the types themselves, as `fn`'s module resolves them, not names this module does not know.
    with contextlib.suppress(NameError, TypeError):
        wrapper.__signature__ = inspect.signature(fn, eval_str=True)  # type: ignore[attr-defined]
        wrapper.__annotations__ = typing.get_type_hints(fn)
    return wrapper


def _api_identity(api_url: str, folder: StateFolder) -> str:
    """The history `api_url` writes to: the local server's database (whatever port it listens on), else the URL."""
    record = folder.read(ServerRecord)
    if record is not None and record.url.rstrip("/") == api_url.rstrip("/"):
        return f"local:{folder.path.resolve()}"
    return api_url.rstrip("/")


def _dead_leases(folder: StateFolder, api_url: str) -> Iterator[tuple[Path, Lease]]:
    """Leases of this host, for `api_url`, whose process is gone (unreadable or very old leases are dropped)."""
    host = socket.gethostname()
    current = _api_identity(api_url, folder)
    for path in sorted(_leases(folder).glob("*.json")):
        age = 0.0
        try:
            age = time.time() - path.stat().st_mtime
            lease = Lease.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            continue  # its run just ended, or another command marked it
        except (OSError, ValueError):
            if age > 60:  # not one being written right now
                path.unlink(missing_ok=True)
            continue
        if lease.host != host or alive(lease.pid, lease.process_start):
            continue
        if (lease.api or (lease.api_url or "").rstrip("/")) != current:
            if age > LEASE_MAX_AGE_S:
                path.unlink(missing_ok=True)
            continue
        yield path, lease


def mark_crashed_runs(api_url: str, home: Path | None = None) -> list[str]:
    """Mark Crashed the runs on `api_url` whose process died holding their lease; never raises. The local server of
    `home` is reached with its auth string, if secured; another API with the environment's.

    Returns the ids of the runs marked. A run already in a final state (its process ended it, then died) is left.
    """
    folder = server_folder(home)
    try:
        dead = list(_dead_leases(folder, api_url))
    except OSError as err:
        log.warning("could not read the flow run leases in %s: %s", _leases(folder), err)
        return []
    if not dead:
        return []
    try:
        return _mark(api_url, dead, _auth_for(api_url, folder, home))
    except Exception as err:  # noqa: BLE001 - marking is a courtesy to the UI: a command never fails over it
        log.warning("could not mark crashed flow runs on %s: %s", api_url, err)
        return []


def end_leased_runs(pid: int, reason: str, wait_s: float = 30.0, home: Path | None = None) -> list[str]:
    """Once process `pid` has ended, mark Cancelled (with `reason`) the flow runs it held leases for and their task
    runs that are not final; for a command that stops on an interrupt without waiting for its tasks. Never raises.

    Run by a helper that outlives the command by a moment: while the command lives, its threads may still start a
    task run, whose state would land after the marks and stay "Running" in the UI forever.
    """
    from prefect.states import Cancelled

    deadline = time.monotonic() + wait_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    folder = server_folder(home)
    by_api: dict[str, list[tuple[Path, Lease]]] = {}
    try:
        for path in sorted(_leases(folder).glob("*.json")):
            with contextlib.suppress(OSError, ValueError):
                lease = Lease.model_validate_json(path.read_bytes())
                if lease.pid == pid and lease.host == socket.gethostname() and lease.api_url:
                    by_api.setdefault(lease.api_url, []).append((path, lease))
        return [
            run_id
            for api_url, leases in by_api.items()
            for run_id in _mark(api_url, leases, _auth_for(api_url, folder, home), lambda _: Cancelled(message=reason))
        ]
    except Exception as err:  # noqa: BLE001 - marking is a courtesy to the UI: the next command marks them Crashed
        log.warning("could not mark the interrupted flow runs: %s", err)
        return []


def _died(lease: Lease) -> State:
    from prefect.states import Crashed

    return Crashed(
        message=f"process {lease.pid} on {lease.host}, which ran this flow run since {lease.started_at}, "
        "died without ending it (killed or out of memory)"
    )


def _auth_for(api_url: str, folder: StateFolder, home: Path | None) -> str | None:
    """The auth string of our own secured server at `api_url`; another API takes the environment's."""
    return server_auth(home) if _api_identity(api_url, folder).startswith("local:") else None


def _mark(
    api_url: str, leases: list[tuple[Path, Lease]], auth: str | None, end: Callable[[Lease], State] = _died
) -> list[str]:
    """Put each lease's flow run in the state `end` gives, unless it is final, and every task run of it that is not:
    the tasks in flight when a process dies never say so themselves. Returns the ids of the flow runs marked."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        FlowRunFilterState,
        FlowRunFilterStateType,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    unfinished = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED, StateType.CANCELLING]
    marked = []
    updates = {PREFECT_API_URL: api_url, **({PREFECT_API_AUTH_STRING: auth} if auth else {})}
    with temporary_settings(updates=updates), get_client(sync_client=True) as client:
        for path, lease in leases:
            try:
                run = client.read_flow_run(UUID(lease.flow_run_id))
            except ObjectNotFound:
                path.unlink(missing_ok=True)
                continue
            if run.state is None or not run.state.is_final():
                client.set_flow_run_state(run.id, end(lease), force=True)
                marked.append(lease.flow_run_id)
            # Its subflow runs ran in the same process: one created but not yet started (Pending) holds no lease of
            # its own, and nothing else would ever end it.
            children = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id]),
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=unfinished)),
                )
            )
            for child in children:
                client.set_flow_run_state(child.id, end(lease), force=True)
            tasks = client.read_task_runs(
                task_run_filter=TaskRunFilter(
                    flow_run_id=TaskRunFilterFlowRunId(any_=[run.id, *(child.id for child in children)]),
                    state=TaskRunFilterState(type=TaskRunFilterStateType(any_=unfinished)),
                )
            )
            for task_run in tasks:
                client.set_task_run_state(task_run.id, end(lease), force=True)
            path.unlink(missing_ok=True)
    return marked
