"""The local Prefect server that lasts: one per user, started on demand, shared by every command, kept running.

Its state folder (`$K6VSR_SERVER_HOME`, else `$K6VSR_STATE_HOME/prefect-server`, else
`$XDG_STATE_HOME/k6vsr/prefect-server` or `~/.local/state/k6vsr/prefect-server`) holds:

    prefect/      the server's own PREFECT_HOME (its database: the history the UI shows)
    server.json   pid, port and URL of the running server, written atomically
    port          the port the server took first: every later start asks for it again, so the UI keeps its address
    server.log    what the server prints
    server.lock   held (fcntl) while a command checks or starts the server, so racing commands start one
    leases/       one file per flow run in progress here: the process that runs it (`runtime.flow_leases`)
    auth          a secured server's auth string (owner-only): only a process that reads it reaches the API
    database.json the database chosen with `k6vsr server start --database` (owner-only; `runtime.server_database`)

The server runs detached, in its own session, so neither a terminal's Ctrl-C nor a killed command stops it. Its
pid is recorded before it is healthy: a command killed while the server starts leaves a server the next command
finds and waits for, never an unrecorded one. `PREFECT_API_URL` (environment or Prefect profile), when set, wins:
no local server is started (`runtime.prefect_api` chooses).

`k6vsr serve` runs a server of its own, secured (`runtime.prefect_api.prefect_api(home, secured=True)`): on
loopback, on a free port of its own, behind Prefect's server auth (`PREFECT_SERVER_API_AUTH_STRING`, a fresh random
string written to `auth`), which its job processes send (`PREFECT_API_AUTH_STRING`) and its HTTP clients never see.
So a client of the HTTP API that can reach the loopback cannot list, read or delete the jobs' flow runs there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shlex
import signal
import socket
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel

from k6vsr_core import settings, status
from k6vsr_core.errors import UserFacingError
from runtime import server_database
from runtime.service_errors import ServerError
from runtime.state_folder import LaunchFailed, StateFolder, now, state_home
from storage.processes import alive
from storage.records import atomic_write_bytes

log = logging.getLogger("k6vsr.prefect_server")

DEFAULT_PORT = 4200  # Prefect's own default: the UI stays at one address while the port is free
STOP_TIMEOUT_S = 20.0
HOST = "127.0.0.1"
HOME_ENV = settings.env_name("server_home")


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
    database: str | None = None  # the running server's database, without its password (`sqlite`: the default)
    secondary: bool = False  # runs without the database-wide services, which another server runs


class ServerRecord(BaseModel):
    pid: int
    port: int
    url: str
    started_at: str
    process_start: int | None = None
    database: str = server_database.SQLITE  # without its password
    secondary: bool = False


# ------------------------------------------------------------------------------------------------ the folder


def server_home() -> Path:
    return state_home(settings.read(settings.Server).server_home, "prefect-server")


def server_folder(home: Path | None = None) -> StateFolder:
    return StateFolder(home or server_home(), "server")


def _auth_path(folder: StateFolder) -> Path:
    return folder.path / "auth"


def auth_path(home: Path | None = None) -> Path:
    """The file of a secured server's auth string: what its UI's login page asks for."""
    return _auth_path(server_folder(home))


def server_auth(home: Path | None = None) -> str | None:
    """The auth string of the local server in `home` if it was started secured, else None."""
    try:
        return auth_path(home).read_text().strip() or None
    except FileNotFoundError:
        return None


def status_command(home: Path | None = None) -> str:
    """The command that shows the server of `home` again: `k6vsr server status`, with `K6VSR_SERVER_HOME` where
    `home` is not the folder it reads by default (another server's)."""
    folder = (home or server_home()).expanduser().resolve()
    if folder == server_home().expanduser().resolve():
        return "k6vsr server status"
    return f"{HOME_ENV}={shlex.quote(str(folder))} k6vsr server status"


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
    given = None if secured else settings.read(settings.Server).server_port
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


def _server_env(home: Path, port: int, auth: str | None, database: server_database.DatabaseChoice) -> dict[str, str]:
    # A UI setting given to commands (they may point at another server) must not reach this server's UI; the
    # database is the one chosen (`server_database.choose`, which read Prefect's setting), never an inherited one.
    dropped = {
        *server_database.PREFECT_SETTINGS,
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
        # Off, as in Prefect's default, and said here because the commands that report to it skip the token
        # (runtime.prefect_api): a client asks for one per new connection otherwise, a request a clip.
        PREFECT_SERVER_CSRF_PROTECTION_ENABLED="false",
    )
    if auth is not None:
        env["PREFECT_SERVER_API_AUTH_STRING"] = auth
    env.update(server_database.server_env(database))
    return env


def _launch(folder: StateFolder, port: int, secured: bool, database: server_database.DatabaseChoice) -> ServerRecord:
    (folder.path / "prefect").mkdir(parents=True, exist_ok=True)
    auth = secrets.token_urlsafe(32) if secured else None
    if auth is None:
        _auth_path(folder).unlink(missing_ok=True)
    else:
        atomic_write_bytes(_auth_path(folder), auth.encode())  # owner-only (mkstemp), before the server can answer
    # `prefect server start`, with SQLite's write transactions taking their lock at BEGIN (runtime.sqlite_writes)
    command = [sys.executable, "-m", "runtime.sqlite_writes", "server", "start", "--host", HOST, "--port", str(port)]
    fields = {
        "port": port,
        "url": f"http://{HOST}:{port}/api",
        "started_at": now(),
        "database": server_database.masked(database.url),
        "secondary": database.secondary,
    }
    try:
        return folder.launch_recorded(command, _server_env(folder.path, port, auth, database), fields, ServerRecord)
    except LaunchFailed as err:
        raise ServerError(f"the Prefect server could not be launched: {err}") from None


def _wait_healthy(record: ServerRecord, timeout: float) -> bool:
    """True once the server answers; False if it died or did not answer within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _healthy(record.url):
            return True
        if not alive(record.pid, record.process_start):
            return False
        time.sleep(0.3)
    return False


def _terminate(record: ServerRecord, timeout: float = STOP_TIMEOUT_S) -> None:
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


def _check_same_database(record: ServerRecord, database: str | None, secondary: bool | None) -> None:
    """A `start --database`/`--secondary` that asks for another database than the running server's is refused: the
    server is not swapped under the commands that use it."""
    wanted = record.database if database is None else server_database.masked(server_database.parse_url(database))
    if wanted != record.database or (secondary is not None and secondary != record.secondary):
        running = f"{record.database}{' (secondary)' if record.secondary else ''}"
        raise UserFacingError(
            f"the local Prefect server (pid {record.pid}) runs on {running}; stop it first (`k6vsr server stop`)"
        )


def start_server(
    home: Path | None = None, secured: bool = False, database: str | None = None, secondary: bool | None = None
) -> str:
    """The local server's API URL: the running one, else one started now (exactly one, however many race).

    `secured`: the server must ask for its auth string (`server_auth(home)`); one found running without it is
    replaced. `database` (`--database`: a PostgreSQL URL or `sqlite`) and `secondary`: see `runtime.server_database`;
    None keeps Prefect's setting, else the remembered choice. A running server on another database is refused."""
    folder = server_folder(home)
    if database is not None:
        server_database.parse_url(database)  # a bad URL is refused before anything else
    record = folder.read(ServerRecord)
    if (
        record
        and (not secured or server_auth(home))
        and alive(record.pid, record.process_start)
        and _healthy(record.url)
    ):
        _check_same_database(record, database, secondary)
        return record.url
    start_s = settings.read(settings.Server).server_start_timeout
    with folder.locked():
        record = folder.read(ServerRecord)
        if record and secured and server_auth(home) is None:
            log.warning(
                "the Prefect server %d at %s asks for no auth string; restarting it secured", record.pid, record.url
            )
            _terminate(record)
        elif record and alive(record.pid, record.process_start):
            # Started by a command that was killed before it was healthy, or busy: give it the start timeout.
            if _wait_healthy(record, start_s):
                _check_same_database(record, database, secondary)
                return record.url
            log.warning("the Prefect server %d at %s does not answer; restarting it", record.pid, record.url)
            _terminate(record)
        folder.remove_record()
        choice = server_database.choose(folder.path, database, secondary)  # checked: it answers, before any start
        last_error = ""
        status.say(
            f"starting the local Prefect server (10-30 s; it keeps running for later commands; log: {folder.log_path})"
        )
        for _attempt in range(2):  # a port taken between the check and the bind: once more on another port
            record = _launch(folder, _pick_port(folder, secured), secured, choice)
            if _wait_healthy(record, start_s):
                if not secured:  # a secured server's caller (`k6vsr serve`) says where its UI is and how to log in
                    status.say(f"Prefect UI: {ui_url(record.url)} (`{status_command(home)}` shows it again)")
                return record.url
            still_running = alive(record.pid, record.process_start)
            _terminate(record)
            folder.remove_record()
            last_error = folder.log_tail()
            if still_running:
                raise ServerError(
                    f"the Prefect server did not answer within {start_s:g} s (K6VSR_SERVER_START_TIMEOUT); "
                    f"its log {folder.log_path} ends:\n{last_error}"
                )
        raise ServerError(f"the Prefect server exited while starting; its log {folder.log_path} ends:\n{last_error}")


def stop_server(home: Path | None = None) -> bool:
    """Stop the local server; False if none was running."""
    return server_folder(home).stop(ServerRecord, _terminate)


def ui_url(api_url: str) -> str:
    """The UI of the server whose API is at `api_url`: the same address without `/api`."""
    return api_url.removesuffix("/api")


def server_status(home: Path | None = None) -> ServerStatus:
    folder = server_folder(home)
    record = folder.read(ServerRecord)
    external = os.environ.get("PREFECT_API_URL") or None
    # Not running: the database its next start would use (unless `--database` or Prefect's setting says otherwise).
    choice = server_database.remembered(folder.path)
    base = ServerStatus(
        running=False,
        home=str(folder.path),
        log=str(folder.log_path),
        external_api_url=external,
        database=server_database.masked(choice.url),
        secondary=choice.secondary,
    )
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
            "database": record.database,
            "secondary": record.secondary,
        }
    )
