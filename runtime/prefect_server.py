"""The local Prefect server that lasts: one per user, started on demand, shared by every command, kept running.

Its state folder (`$K6VSR_SERVER_HOME`, else `$K6VSR_HOME/prefect-server`, else
`$XDG_STATE_HOME/k6vsr/prefect-server` or `~/.local/state/k6vsr/prefect-server`) holds:

    prefect/      the server's own PREFECT_HOME (its database: the history the UI shows)
    server.json   pid, port and URL of the running server, written atomically
    port          the port the server took first: every later start asks for it again, so the UI keeps its address
    server.log    what the server prints
    server.lock   held (fcntl) while a command checks or starts the server, so racing commands start one
    leases/       one file per flow run in progress here: the process that runs it
    auth          a secured server's auth string (owner-only): only a process that reads it reaches the API

The server runs detached, in its own session, so neither a terminal's Ctrl-C nor a killed command stops it. Its
pid is recorded before it is healthy: a command killed while the server starts leaves a server the next command
finds and waits for, never an unrecorded one. `PREFECT_API_URL` (environment or Prefect profile), when set, wins:
no local server is started.

A flow run holds a lease (`leased`) while its body runs. A process killed outright (SIGKILL, OOM) cannot tell the
API its run ended, so the run would show "Running" forever; the next command that reaches the API finds the lease's
process dead and marks the run Crashed, with its task runs that were in flight (`mark_crashed_runs`). A command
stopped by Ctrl-C leaves a helper that marks its runs Cancelled as soon as it is gone (`end_leased_runs`).

`k6vsr serve` runs a server of its own, secured (`prefect_api(home, secured=True)`): on loopback, on a free port of
its own, behind Prefect's server auth (`PREFECT_SERVER_API_AUTH_STRING`, a fresh random string written to `auth`),
which its job processes send (`PREFECT_API_AUTH_STRING`) and its HTTP clients never see. So a client of the HTTP API
that can reach the loopback cannot list, read or delete the jobs' flow runs there.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import typing
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from pydantic import BaseModel

from k6vsr_core import status
from k6vsr_core.errors import ServerError
from runtime import interrupts
from runtime.state_folder import StateFolder, now, state_home
from storage.processes import alive, process_start
from storage.records import atomic_write_bytes

if TYPE_CHECKING:
    from prefect.states import State

log = logging.getLogger("k6vsr.prefect_server")

DEFAULT_PORT = 4200  # Prefect's own default: the UI stays at one address while the port is free
START_TIMEOUT_S = float(os.environ.get("K6VSR_SERVER_START_TIMEOUT", "180"))
STOP_TIMEOUT_S = 20.0
LEASE_MAX_AGE_S = 30 * 24 * 3600  # a lease whose API was never current again is dropped after this
HOST = "127.0.0.1"
HOME_ENV = "K6VSR_SERVER_HOME"

P = ParamSpec("P")
R = TypeVar("R")


class ServerStatus(BaseModel):
    running: bool
    pid: int | None = None
    url: str | None = None
    ui_url: str | None = None
    home: str
    log: str
    started_at: str | None = None
    uptime_s: float | None = None
    external_api_url: str | None = None  # PREFECT_API_URL, when set: commands report there instead


class _Record(BaseModel):
    pid: int
    port: int
    url: str
    started_at: str
    process_start: int | None = None


class Lease(BaseModel):
    flow_run_id: str
    pid: int
    host: str
    api_url: str | None
    api: str | None = None  # which history the run is in (`_api_identity`): the local server keeps its across ports
    started_at: str
    process_start: int | None = None


# ------------------------------------------------------------------------------------------------ the folder


def server_home() -> Path:
    return state_home(HOME_ENV, "prefect-server")


def _folder(home: Path | None) -> StateFolder:
    return StateFolder(home or server_home(), "server")


def _leases(folder: StateFolder) -> Path:
    return folder.path / "leases"


def _auth_path(folder: StateFolder) -> Path:
    return folder.path / "auth"


def server_auth(home: Path | None = None) -> str | None:
    """The auth string of the local server in `home` if it was started secured, else None."""
    try:
        return _auth_path(_folder(home)).read_text().strip() or None
    except FileNotFoundError:
        return None


# --------------------------------------------------------------------------------------------- processes


def _healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            return response.status == 200
    except (OSError, ValueError):
        return False


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        # As the server binds (uvicorn): a port its previous run left in TIME_WAIT is free for it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _port_path(folder: StateFolder) -> Path:
    return folder.path / "port"


def _remembered_port(folder: StateFolder) -> int | None:
    try:
        return int(_port_path(folder).read_text().strip()) or None
    except (OSError, ValueError):
        return None


def _pick_port(folder: StateFolder, secured: bool = False) -> int:
    """`K6VSR_SERVER_PORT` when set; else the port this server had before, else the default, while it is free, and
    otherwise a free one, remembered, so that the UI keeps one address across restarts. A secured server takes a
    free one of its own, never the port of the user's server."""
    given = None if secured else os.environ.get("K6VSR_SERVER_PORT")
    if secured:
        wanted = 0
    elif given is not None:
        wanted = int(given)
    else:
        wanted = _remembered_port(folder) or DEFAULT_PORT
    if wanted and _port_free(wanted):
        port = wanted
    else:
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port = sock.getsockname()[1]
    if not secured and given is None and port != _remembered_port(folder):
        atomic_write_bytes(_port_path(folder), f"{port}\n".encode())
    return port


def _server_env(home: Path, port: int, auth: str | None) -> dict[str, str]:
    # A UI setting given to commands (they may point at another server) must not reach this server's UI.
    dropped = {
        "PREFECT_API_URL",
        "PREFECT_PROFILE",
        "PREFECT_UI_URL",
        "PREFECT_UI_API_URL",
        "PREFECT_API_AUTH_STRING",
        "PREFECT_SERVER_API_AUTH_STRING",
    }
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(
        PREFECT_HOME=str(home / "prefect"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",  # offline they would only log connection errors
        PREFECT_SERVER_API_HOST=HOST,
        PREFECT_SERVER_API_PORT=str(port),
        # The UI asks `/ui-settings` where its API is; Prefect answers from the settings, not from `--port`, so
        # without this a server started on another port than 4200 would send its UI to 4200.
        PREFECT_SERVER_UI_API_URL=f"http://{HOST}:{port}/api",
    )
    if auth is not None:
        env["PREFECT_SERVER_API_AUTH_STRING"] = auth
    return env


# The launcher forks the server into its own session, records it and exits, so the server is nobody's child: a
# long-lived command (`k6vsr serve`) never holds it as a zombie, and killing the command (or its process group)
# never reaches it. The launcher, not the command, writes the record: a command killed right after the launch still
# leaves a recorded server, which the next command finds and waits for.
_LAUNCHER = """
import json, os, subprocess, sys, time
record_path, log_path, port, started_at = sys.argv[1:5]
with open(log_path, "ab") as log:
    process = subprocess.Popen(sys.argv[5:], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True, close_fds=True)
try:
    with open(f"/proc/{process.pid}/stat") as stat:
        process_start = int(stat.read().rsplit(")", 1)[1].split()[19])
except OSError:
    process_start = None
record = {"pid": process.pid, "port": int(port), "url": f"http://127.0.0.1:{port}/api", "started_at": started_at,
          "process_start": process_start}
partial = f"{record_path}.{os.getpid()}.partial"
with open(partial, "w") as handle:
    json.dump(record, handle)
    handle.flush()
    os.fsync(handle.fileno())
os.replace(partial, record_path)
"""


def _launch(folder: StateFolder, port: int, secured: bool) -> _Record:
    (folder.path / "prefect").mkdir(parents=True, exist_ok=True)
    auth = secrets.token_urlsafe(32) if secured else None
    if auth is None:
        _auth_path(folder).unlink(missing_ok=True)
    else:
        atomic_write_bytes(_auth_path(folder), auth.encode())  # owner-only (mkstemp), before the server can answer
    folder.rotate_log()
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(port)]
    launcher = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, str(folder.record_path), str(folder.log_path), str(port), now(), *command],
        env=_server_env(folder.path, port, auth),
        cwd=folder.path,  # never the command's folder, which the server would otherwise keep busy for its lifetime
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        start_new_session=True,
        check=False,
        timeout=60,
    )
    record = folder.read(_Record)
    if launcher.returncode != 0 or record is None:
        raise ServerError(f"the Prefect server could not be launched: {launcher.stderr.strip()[-2000:]}")
    return record


def _wait_healthy(record: _Record, timeout: float) -> bool:
    """True once the server answers; False if it died or did not answer within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _healthy(record.url):
            return True
        if not alive(record.pid, record.process_start):
            return False
        time.sleep(0.3)
    return False


def _terminate(record: _Record, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after `timeout`."""
    if not alive(record.pid, record.process_start):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(record.pid, sig)  # the server leads its own session and group
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and alive(record.pid, record.process_start):
            time.sleep(0.1)
        if not alive(record.pid, record.process_start):
            return


# ------------------------------------------------------------------------------------------------ the API


def configured_api_url() -> str | None:
    """`PREFECT_API_URL` from the environment or the active Prefect profile, if any."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


def start_server(home: Path | None = None, secured: bool = False) -> str:
    """The local server's API URL: the running one, else one started now (exactly one, however many race).

    `secured`: the server must ask for its auth string (`server_auth(home)`); one found running without it is
    replaced."""
    folder = _folder(home)
    record = folder.read(_Record)
    if (
        record
        and (not secured or server_auth(home))
        and alive(record.pid, record.process_start)
        and _healthy(record.url)
    ):
        return record.url
    with folder.locked():
        record = folder.read(_Record)
        if record and secured and server_auth(home) is None:
            log.warning(
                "the Prefect server %d at %s asks for no auth string; restarting it secured", record.pid, record.url
            )
            _terminate(record)
        elif record and alive(record.pid, record.process_start):
            # Started by a command that was killed before it was healthy, or busy: give it the start timeout.
            if _wait_healthy(record, START_TIMEOUT_S):
                return record.url
            log.warning("the Prefect server %d at %s does not answer; restarting it", record.pid, record.url)
            _terminate(record)
        folder.remove_record()
        last_error = ""
        status.say(
            f"starting the local Prefect server (10-30 s; it keeps running for later commands; log: {folder.log_path})"
        )
        for _attempt in range(2):  # a port taken between the check and the bind: once more on another port
            record = _launch(folder, _pick_port(folder, secured), secured)
            if _wait_healthy(record, START_TIMEOUT_S):
                status.say(f"Prefect UI: {ui_url(record.url)} (`k6vsr server status` shows it again)")
                return record.url
            still_running = alive(record.pid, record.process_start)
            _terminate(record)
            folder.remove_record()
            last_error = folder.log_tail()
            if still_running:
                raise ServerError(
                    f"the Prefect server did not answer within {START_TIMEOUT_S:g} s (K6VSR_SERVER_START_TIMEOUT); "
                    f"its log {folder.log_path} ends:\n{last_error}"
                )
        raise ServerError(f"the Prefect server exited while starting; its log {folder.log_path} ends:\n{last_error}")


def ensure_server(home: Path | None = None, secured: bool = False) -> str:
    """The API URL every command reports to: `PREFECT_API_URL` if set, else the local server in `home` (started if
    absent; `secured`: behind an auth string, `api_auth(home)`).

    Flow runs whose process died without ending them are marked Crashed on the way.
    """
    url = configured_api_url() or start_server(home, secured)
    mark_crashed_runs(url, home)
    return url


def api_auth(home: Path | None = None) -> str | None:
    """The auth string `ensure_server(home)`'s API takes: None for a configured `PREFECT_API_URL` (its profile says
    what it needs), else the local server's, if secured."""
    return None if configured_api_url() else server_auth(home)


def stop_server(home: Path | None = None) -> bool:
    """Stop the local server; False if none was running."""
    return _folder(home).stop(_Record, _terminate)


def ui_url(api_url: str) -> str:
    """The UI of the server whose API is at `api_url`: the same address without `/api`."""
    return api_url.removesuffix("/api")


def server_status(home: Path | None = None) -> ServerStatus:
    folder = _folder(home)
    record = folder.read(_Record)
    external = os.environ.get("PREFECT_API_URL") or None
    base = ServerStatus(running=False, home=str(folder.path), log=str(folder.log_path), external_api_url=external)
    if record is None or not alive(record.pid, record.process_start) or not _healthy(record.url):
        return base
    started = datetime.fromisoformat(record.started_at)
    return base.model_copy(
        update={
            "running": True,
            "pid": record.pid,
            "url": record.url,
            "ui_url": ui_url(record.url),
            "started_at": record.started_at,
            "uptime_s": round((datetime.now(UTC) - started).total_seconds(), 1),
        }
    )


@contextlib.contextmanager
def prefect_api(home: Path | None = None, secured: bool = False) -> Iterator[str]:
    """Report to `ensure_server(home, secured)`'s API for the block; child processes (Dask workers, job processes)
    inherit it, its auth string and its home."""
    from prefect.settings import (
        PREFECT_API_AUTH_STRING,
        PREFECT_API_URL,
        PREFECT_SERVER_ANALYTICS_ENABLED,
        temporary_settings,
    )

    url = ensure_server(home, secured)
    auth = api_auth(home)
    exported = {"PREFECT_API_URL": url, **({"PREFECT_API_AUTH_STRING": auth} if auth else {})}
    if home is not None:  # flow runs hold their leases beside the server they report to
        exported[HOME_ENV] = str(home)
    saved = {name: os.environ.get(name) for name in exported}
    os.environ.update(exported)
    updates = {PREFECT_API_URL: url, PREFECT_SERVER_ANALYTICS_ENABLED: False}
    if auth:
        updates[PREFECT_API_AUTH_STRING] = auth
    try:
        with temporary_settings(updates=updates):
            yield url
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ------------------------------------------------------------------------------------------------- leases


@contextlib.contextmanager
def flow_run_lease(flow_run_id: str | None, home: Path | None = None) -> Iterator[None]:
    """While the block runs, a lease names this process as the one running `flow_run_id`."""
    if not flow_run_id:
        yield
        return
    from prefect.settings import PREFECT_API_URL

    folder = _folder(home)
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
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


# Kept beside Prefect's flow heartbeats: those are events sent every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (30 at
# the least, prefect 3.9), and a run whose heartbeats stop is marked Crashed only by an automation someone created on
# the server. A lease names the process itself (pid and start time), so the next command on this host knows at once,
# on any Prefect API, even one that is not ours to configure, that the run's process is gone.
def leased(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate a flow's function (below `@flow`) so its run holds a lease while its body runs."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        from prefect.runtime import flow_run

        with flow_run_lease(flow_run.id), interrupts.noting_signals():
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
    record = folder.read(_Record)
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
    folder = _folder(home)
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
    folder = _folder(home)
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
            tasks = client.read_task_runs(
                task_run_filter=TaskRunFilter(
                    flow_run_id=TaskRunFilterFlowRunId(any_=[run.id]),
                    state=TaskRunFilterState(type=TaskRunFilterStateType(any_=unfinished)),
                )
            )
            for task_run in tasks:
                client.set_task_run_state(task_run.id, end(lease), force=True)
            path.unlink(missing_ok=True)
    return marked
