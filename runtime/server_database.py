"""Which database the local Prefect server keeps its history in: SQLite in its state folder (the default), or a
PostgreSQL server (`k6vsr server start --database postgresql+asyncpg://USER:PASSWORD@HOST:PORT/DB`).

The choice is remembered in the state folder (`database.json`, owner-only: the URL may hold a password), so that a
later `start`, whichever command makes it, and `status` agree with the `start` that made it. Prefect's own setting,
`PREFECT_SERVER_DATABASE_CONNECTION_URL` (or its older name `PREFECT_API_DATABASE_CONNECTION_URL`) in the
environment, is honoured where no `--database` is given; `--database sqlite` goes back to the default.

Several API servers on one PostgreSQL database: every server records the task runs, events and logs its own
clients send it (Prefect 3 clients send task-run states as events, which each server's in-process services write to
the database), but the loop services that act on the whole database (the scheduler, late runs, the foreman,
cancellation cleanup, pause expirations, the repossessor, the vacuum) must run once: a server started `secondary`
runs without them, leaving them to the first. (Prefect's own multi-server setup, `--no-services` API servers behind
one `prefect server services start`, needs Redis to carry the events from the API servers to the services; without
it an API server's task runs would never be written.)
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TypeGuard

from pydantic import BaseModel
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from k6vsr_core.errors import UserFacingError
from runtime.service_errors import ServerError
from storage.records import atomic_write_bytes

SQLITE = "sqlite"  # the `--database` value that names the default: SQLite in the state folder
DRIVER = "postgresql+asyncpg"
SQLITE_DRIVER = "sqlite+aiosqlite"
PREFECT_SETTINGS = ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")
CONNECT_TIMEOUT_S = 10.0

# The services that act on the whole database, each Prefect's `PREFECT_SERVER_SERVICES_<NAME>_ENABLED`: a secondary
# server turns them off. The task-run recorder, the event persister and the triggers stay: they handle what this
# server's own clients send it, which no other server sees.
DATABASE_WIDE_SERVICES = (
    "SCHEDULER",
    "LATE_RUNS",
    "FOREMAN",
    "CANCELLATION_CLEANUP",
    "PAUSE_EXPIRATIONS",
    "REPOSSESSOR",
    "DB_VACUUM",
    "CLEANUP_RECONCILER",
)


class DatabaseChoice(BaseModel):
    """What `database.json` remembers: the PostgreSQL URL (None: SQLite in the state folder) and whether the server
    is a secondary one."""

    url: str | None = None
    secondary: bool = False


def _choice_path(folder: Path) -> Path:
    return folder / "database.json"


def parse_url(given: str) -> str | None:
    """The PostgreSQL URL `given`, checked, or None for `sqlite`. A URL k6vsr cannot use is refused here."""
    if given.strip().lower() == SQLITE:
        return None
    try:
        url = make_url(given.strip())
    except ArgumentError:
        raise UserFacingError(
            f"--database: {masked(given)!r} is not a database URL; give {DRIVER}://USER:PASSWORD@HOST:PORT/DATABASE "
            f"or {SQLITE}"
        ) from None
    if url.drivername == SQLITE_DRIVER:  # a SQLite file elsewhere, as Prefect's own setting may name
        return url.render_as_string(hide_password=False)
    if url.drivername != DRIVER:
        raise UserFacingError(
            f"--database: the driver {url.drivername!r} is not supported; give {DRIVER}://USER:PASSWORD@HOST:PORT/"
            f"DATABASE (Prefect's PostgreSQL driver) or {SQLITE}"
        )
    if not url.database:
        raise UserFacingError(f"--database: {masked(given)} names no database (…/DATABASE at its end)")
    if not (url.host or url.query.get("host")):
        raise UserFacingError(f"--database: {masked(given)} names no host (HOST, or ?host=/a/socket/folder)")
    return url.render_as_string(hide_password=False)


def is_postgres(url: str | None) -> TypeGuard[str]:
    return url is not None and make_url(url).drivername == DRIVER


def masked(url: str | None) -> str:
    """`url` without its password, for status lines and errors; `sqlite` for the default."""
    if url is None:
        return SQLITE
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "(an unparsable URL)"


def remembered(folder: Path) -> DatabaseChoice:
    try:
        return DatabaseChoice.model_validate_json(_choice_path(folder).read_bytes())
    except (OSError, ValueError):
        return DatabaseChoice()


def remember(folder: Path, choice: DatabaseChoice) -> None:
    atomic_write_bytes(_choice_path(folder), choice.model_dump_json().encode())  # owner-only (mkstemp)


def prefect_setting() -> str | None:
    """Prefect's own database setting, where the user set it in the environment."""
    for name in PREFECT_SETTINGS:
        value = os.environ.get(name)
        if value:
            return value
    return None


def choose(folder: Path, given: str | None = None, secondary: bool | None = None) -> DatabaseChoice:
    """The database a start of the server in `folder` uses: `given` (`--database`), else Prefect's setting, else the
    remembered choice, else SQLite. Checked (the URL, then a connection), so nothing starts on a database that
    cannot serve; remembered when given."""
    before = remembered(folder)
    if given is not None:
        url = parse_url(given)
    else:
        setting = prefect_setting()
        url = parse_url(setting) if setting else before.url
    choice = DatabaseChoice(url=url, secondary=before.secondary if secondary is None else secondary)
    if choice.secondary and not is_postgres(choice.url):
        raise UserFacingError(
            "--secondary: a secondary server shares a PostgreSQL database with another one; give --database "
            f"{DRIVER}://… (on SQLite one server is all there can be)"
        )
    if is_postgres(choice.url):
        check_reachable(choice.url)
    if given is not None or secondary is not None:
        remember(folder, choice)
    return choice


def check_reachable(url: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Connect to the PostgreSQL database at `url` and ask it one question; a ServerError saying why not."""
    import asyncpg  # Prefect's PostgreSQL driver; imported only for a PostgreSQL database

    parsed: URL = make_url(url)

    async def probe() -> None:
        connection = await asyncpg.connect(
            host=parsed.host or parsed.query.get("host"),
            port=parsed.port,
            user=parsed.username,
            password=parsed.password,
            database=parsed.database,
            timeout=timeout,
        )
        try:
            await connection.fetchval("SELECT 1")
        finally:
            await connection.close()

    try:
        asyncio.run(asyncio.wait_for(probe(), timeout + 1))
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as err:
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ServerError(f"the database {masked(url)} cannot be reached: {cause}") from None


def server_env(choice: DatabaseChoice) -> dict[str, str]:
    """The settings the server process is started with for `choice`."""
    if choice.url is None:
        return {}
    env = {"PREFECT_SERVER_DATABASE_CONNECTION_URL": choice.url}
    if choice.secondary:
        env.update({f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in DATABASE_WIDE_SERVICES})
    return env
