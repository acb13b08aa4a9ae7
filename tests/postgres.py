"""A real PostgreSQL server for a test: Debian's `postgresql` package's binaries, a cluster of its own in a fresh
folder, on a free loopback port, stopped (and its folder removed) at the end, leaving no process.

PostgreSQL refuses to run as root: as root, the cluster belongs to the `postgres` user the package creates and its
commands run as that user (`runuser`). Absent binaries are a failure, not a skip: `.ci/run` installs them.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

USER = "k6vsr"
PASSWORD = "not-to-be-shown"  # trust authentication ignores it; the tests check that no output shows it


@dataclass(frozen=True)
class Postgres:
    folder: Path
    port: int

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+asyncpg://{USER}:{PASSWORD}@127.0.0.1:{self.port}/{database}"

    def pid(self) -> int | None:
        """The postmaster's pid while it runs (its `postmaster.pid` names it)."""
        try:
            return int((self.folder / "data" / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None


def _bindir() -> Path:
    for name in ("pg_ctl", "initdb"):
        found = shutil.which(name)
        if found:
            return Path(found).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if not candidates:
        pytest.fail(
            "PostgreSQL's server binaries (initdb, pg_ctl) are not installed: `apt-get install postgresql` "
            "(Debian; `.ci/run` installs it where it is missing)",
            pytrace=False,
        )
    return Path(candidates[-1]).parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_postgres() -> Iterator[Postgres]:
    bindir = _bindir()
    as_user: list[str] = []
    folder = Path(tempfile.mkdtemp(prefix="k6vsr-pg-"))
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        os.chown(folder, owner.pw_uid, owner.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    port = _free_port()
    data = folder / "data"

    def pg(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*as_user, *argv], capture_output=True, text=True, timeout=120, check=False)

    try:
        init = pg(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", USER, "-E", "UTF8", "--no-sync")
        assert init.returncode == 0, init.stderr[-2000:]
        options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off"
        start = pg(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(folder / "log"), "-o", options, "-w", "start")
        assert start.returncode == 0, start.stderr[-2000:] + (folder / "log").read_text(errors="replace")[-2000:]
        yield Postgres(folder, port)
    finally:
        if (data / "postmaster.pid").exists():
            pg(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(folder, ignore_errors=True)
