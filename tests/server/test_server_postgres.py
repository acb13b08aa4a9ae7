"""`k6vsr server start --database postgresql+asyncpg://…`: the local Prefect server on a real PostgreSQL (started
here, `tests/postgres.py`), a run through it landing in that database, a second (secondary) API server on the same
database reading what the first wrote and recording its own clients' runs, bad or unreachable databases refused
before anything starts, and nothing left running at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import procs
import pytest
from postgres import PASSWORD, Postgres, running_postgres

from bench import fake_model
from runtime import prefect_server
from storage.processes import alive

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "entrypoints.cli"]


def _env(home: Path, **extra: str) -> dict[str, str]:
    dropped = {"PREFECT_API_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL"}
    env = {key: value for key, value in os.environ.items() if key not in dropped}
    env.update(
        K6VSR_SERVER_HOME=str(home),
        K6VSR_SERVER_PORT="0",  # any free port: never the user's 4200
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        **extra,
    )
    return env


def _k6vsr(home: Path, *argv: str, timeout: float = 240, **extra: str) -> subprocess.CompletedProcess[str]:
    return procs.run([*CLI, *argv], env=_env(home, **extra), cwd=ROOT, timeout=timeout)


def _query(postgres: Postgres, sql: str) -> list[tuple]:
    import asyncpg

    async def fetch() -> list[tuple]:
        connection = await asyncpg.connect(host="127.0.0.1", port=postgres.port, user="k6vsr", database="postgres")
        try:
            return [tuple(row) for row in await connection.fetch(sql)]
        finally:
            await connection.close()

    return asyncio.run(fetch())


def _servers_of(home: Path) -> list[int]:
    """The pids of every process started as the server of `home` (its PREFECT_HOME is in their environment)."""
    marker = f"PREFECT_HOME={home / 'prefect'}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "environ").read_bytes().split(b"\0"):
                if (proc / "stat").read_text().split()[2] != "Z":
                    found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    with running_postgres() as server:
        pid = server.pid()
        assert pid is not None
        yield server
    assert not alive(pid), "the PostgreSQL server outlived its test"


@pytest.fixture(scope="module")
def homes(tmp_path_factory: pytest.TempPathFactory, postgres: Postgres) -> Iterator[tuple[Path, Path]]:
    """The state folders of the two servers (primary, secondary); whatever runs from them is stopped at the end,
    before PostgreSQL."""
    first, second = tmp_path_factory.mktemp("pg-primary"), tmp_path_factory.mktemp("pg-secondary")
    yield first, second
    for home in (first, second):
        prefect_server.stop_server(home)
        for pid in _servers_of(home):  # whatever a failed test left: never a stray server
            os.kill(pid, signal.SIGKILL)


def _flow_runs(postgres: Postgres) -> dict[str, str]:
    """Every flow run in the database: id -> state type."""
    return {str(run_id): state for run_id, state in _query(postgres, "SELECT id, state_type FROM flow_run")}


def _read(api: str, flow_run_id: str) -> str:
    """The state type of a flow run, read through the API server at `api`."""
    with urllib.request.urlopen(f"{api}/flow_runs/{flow_run_id}", timeout=30) as response:
        return json.loads(response.read())["state_type"]


def _task_runs(postgres: Postgres, flow_runs: dict[str, str], wait_s: float = 30.0) -> int:
    """The task runs of `flow_runs` in the database, once their count settles: a server writes them from the
    events its clients sent, a moment after the flow run ended."""
    ids = ", ".join(f"'{run_id}'" for run_id in flow_runs)
    deadline, last = time.monotonic() + wait_s, -1
    while True:
        count = _query(postgres, f"SELECT count(*) FROM task_run WHERE flow_run_id IN ({ids})")[0][0]
        if (count and count == last) or time.monotonic() > deadline:
            return count
        last = count
        time.sleep(0.5)


# A flow of two tasks, run by a plain Prefect client at PREFECT_API_URL.
TINY_FLOW = """
from prefect import flow, task
@task
def double(x: int) -> int:
    return 2 * x
@flow
def probe() -> int:
    return double(double(1))
assert probe() == 4
"""


def _upscale(home: Path, clip: Path, out: Path, bundle: Path) -> None:
    result = _k6vsr(
        home,
        "upscale",
        str(clip),
        "-o",
        str(out),
        "--model",
        str(bundle),
        "--device",
        "cpu",
        "--scale",
        "2",
        "--json",
        **fake_model.environment(1.0),  # the networks cost ~nothing: the run is the orchestration's
        K6VSR_STORE=str(out.parent / "store"),
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from k6vsr_core.media.sample import make_sample_clip

    path = tmp_path_factory.mktemp("pg-clip") / "clip.mp4"
    make_sample_clip(path, width=64, height=64, num_frames=1)
    return path


def test_bad_or_unreachable_databases_are_refused_before_anything_starts(
    tmp_path: Path, postgres: Postgres, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from entrypoints import cli

    home = tmp_path / "server-home"
    for name, value in _env(home).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    refused = {
        "mysql://k6vsr@127.0.0.1/db": (2, "the driver 'mysql' is not supported"),
        "postgresql+asyncpg://k6vsr@127.0.0.1": (2, "names no database"),
        "not a url": (2, "is not a database URL"),
        postgres.url("missing_db"): (1, 'database "missing_db" does not exist'),
        f"postgresql+asyncpg://k6vsr:{PASSWORD}@127.0.0.1:9/postgres": (1, "cannot be reached"),
    }
    for url, (code, cause) in refused.items():
        assert cli.main(["server", "start", "--database", url]) == code, url
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("k6vsr: error: ") and cause in lines[0], (url, lines)
        assert PASSWORD not in err
    assert cli.main(["server", "start", "--secondary"]) == 2
    assert "shares a PostgreSQL database" in capsys.readouterr().err
    assert cli.main(["server", "status", "--database", postgres.url()]) == 2
    assert "go with `k6vsr server start`" in capsys.readouterr().err
    assert not (home / "server.json").exists() and not (home / "database.json").exists()
    assert _servers_of(home) == []


def test_a_run_lands_in_postgresql_and_a_secondary_server_shares_it(
    homes: tuple[Path, Path], postgres: Postgres, clip: Path, tiny_bundle_path: Path, tmp_path: Path
) -> None:
    first, second = homes
    start = _k6vsr(first, "server", "start", "--database", postgres.url())
    assert start.returncode == 0, start.stderr[-3000:]
    status = json.loads(_k6vsr(first, "server", "status", "--json").stdout)
    assert status["running"] and not status["secondary"]
    assert status["database"] == f"postgresql+asyncpg://k6vsr:***@127.0.0.1:{postgres.port}/postgres"
    assert PASSWORD not in (first / "server.json").read_text()
    assert (first / "database.json").stat().st_mode & 0o077 == 0  # the remembered URL holds the password
    # A later start with no --database agrees with the one that made the server; asking for another is refused.
    again = _k6vsr(first, "server", "start", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["pid"] == status["pid"], again.stderr[-2000:]
    other = _k6vsr(first, "server", "start", "--database", "sqlite")
    assert other.returncode == 2 and "stop it first" in other.stderr

    # A second API server on the same database (started while the first serves a run: a start costs 10-20 s).
    secondary = subprocess.Popen(
        [*CLI, "server", "start", "--database", postgres.url(), "--secondary"],
        env=_env(second),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert _flow_runs(postgres) == {}  # a database of its own: every flow run in it is this test's
        _upscale(first, clip, tmp_path / "out.mp4", tiny_bundle_path)
        runs = _flow_runs(postgres)
        assert runs and set(runs.values()) == {"COMPLETED"}, runs
        assert _task_runs(postgres, runs) > 0
        _, err = secondary.communicate(timeout=240)
    finally:
        if secondary.poll() is None:
            secondary.kill()
    assert secondary.returncode == 0, err[-3000:]

    # The second server reads what the first wrote...
    info = prefect_server.server_status(second)
    assert info.running and info.secondary and info.url != status["url"] and info.database == status["database"]
    assert {run_id: _read(info.url, run_id) for run_id in runs} == runs
    # ...runs without the database-wide services (they run once, on the first)...
    environ = Path(f"/proc/{info.pid}/environ").read_bytes().split(b"\0")
    assert b"PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED=false" in environ
    assert b"PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED=false" in environ
    # ...and records its own clients' runs, task runs included (they come to it as events, which it writes).
    client = procs.run([sys.executable, "-c", TINY_FLOW], env=_env(second, PREFECT_API_URL=info.url), cwd=ROOT)
    assert client.returncode == 0, client.stderr[-3000:]
    later = {run_id: state for run_id, state in _flow_runs(postgres).items() if run_id not in runs}
    assert list(later.values()) == ["COMPLETED"], later
    assert {run_id: _read(status["url"], run_id) for run_id in later} == later  # and the first reads it
    assert _task_runs(postgres, later) == 2

    for home in (second, first):
        stop = _k6vsr(home, "server", "stop", "--json")
        assert stop.returncode == 0 and json.loads(stop.stdout)["stopped"] is True, stop.stderr[-2000:]
        assert _servers_of(home) == []
    # Stopped, the server still says where its next start keeps the history.
    assert prefect_server.server_status(first).database == status["database"]


def test_the_choice_is_remembered_and_prefects_own_setting_honoured(
    tmp_path: Path, postgres: Postgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runtime import server_database

    for name in server_database.PREFECT_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    folder = tmp_path / "server-home"
    chosen = server_database.choose(folder, postgres.url())
    assert chosen.url == postgres.url() and server_database.remembered(folder) == chosen
    assert server_database.choose(folder) == chosen  # a later start with no --database: the remembered one
    # Prefect's own setting, where set, wins over the remembered choice (and is not remembered itself).
    monkeypatch.setenv("PREFECT_SERVER_DATABASE_CONNECTION_URL", postgres.url("template1"))
    assert server_database.choose(folder).url == postgres.url("template1")
    assert server_database.remembered(folder) == chosen
    # --database sqlite goes back to the default, and the server is started without any inherited database setting.
    assert server_database.choose(folder, "sqlite") == server_database.DatabaseChoice()
    assert server_database.remembered(folder).url is None
    env = prefect_server._server_env(folder, 4242, None, server_database.DatabaseChoice())
    assert not set(server_database.PREFECT_SETTINGS) & set(env)
    secondary = server_database.server_env(server_database.DatabaseChoice(url=postgres.url(), secondary=True))
    assert secondary["PREFECT_SERVER_DATABASE_CONNECTION_URL"] == postgres.url()
    assert {f"PREFECT_SERVER_SERVICES_{name}_ENABLED" for name in server_database.DATABASE_WIDE_SERVICES} <= {
        name for name, value in secondary.items() if value == "false"
    }


def test_absent_postgresql_binaries_fail_the_tests_saying_how_to_install_them(monkeypatch: pytest.MonkeyPatch) -> None:
    import postgres as harness

    monkeypatch.setattr(harness.shutil, "which", lambda name: None)
    monkeypatch.setattr(harness.glob, "glob", lambda pattern: [])
    with pytest.raises(pytest.fail.Exception, match="apt-get install postgresql"), harness.running_postgres():
        pass
