"""The local Prefect server that lasts: started once however many commands race, reused, stopped, and the runs of a
killed process marked Crashed. Every test works in its own state folder, on a free port, with `PREFECT_API_URL`
unset, and the servers started here are stopped at the end; one server is shared by the whole module (a start costs
10-15 s).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import procs
import pytest

from runtime import flow_leases, prefect_server

ROOT = Path(__file__).resolve().parents[2]


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    env.update(
        K6VSR_SERVER_HOME=str(home),
        K6VSR_SERVER_PORT="0",  # any free port: never the user's 4200
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        PREFECT_LOGGING_TO_API_ENABLED="false",
        **extra,
    )
    return env


def _python(code: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _servers_of(home: Path) -> list[int]:
    """The pids of every process started as the server of `home` (its PREFECT_HOME is in their environment)."""
    marker = f"PREFECT_HOME={home / 'prefect'}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0") and (proc / "stat").read_text().split()[2] != "Z":
                found.append(int(proc.name))
        except OSError:
            continue
    return found


ENSURE = "from runtime.prefect_api import ensure_server; print(ensure_server())"


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("server-home")
    yield home
    prefect_server.stop_server(home)
    for pid in _servers_of(home):  # whatever a failed test left: never a stray server
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def url(home: Path) -> str:
    """Three commands racing to start the server: one server, one URL for all."""
    racers = [_python(ENSURE, _env(home)) for _ in range(3)]
    outputs = [racer.communicate(timeout=240) for racer in racers]
    for racer, (_, err) in zip(racers, outputs, strict=True):
        assert racer.returncode == 0, err[-3000:]
    urls = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(urls) == 1, urls
    return urls.pop()


def test_racing_commands_start_one_server_that_status_reports(home: Path, url: str) -> None:
    assert len(_servers_of(home)) == 1
    record = json.loads((home / "server.json").read_text())
    status = prefect_server.server_status(home)
    assert status.running and status.url == url and status.pid == record["pid"]
    assert status.ui_url == url.removesuffix("/api") and status.uptime_s is not None
    assert (home / "prefect").is_dir() and (home / "server.log").is_file()
    # The server is nobody's child and leads its own session: killing a command's process group never reaches it.
    stat = Path(f"/proc/{record['pid']}/stat").read_text()
    ppid, pgid, sid = (int(field) for field in stat[stat.rindex(")") + 2 :].split()[1:4])
    assert pgid == sid == record["pid"] and ppid != os.getpid()


def test_a_later_command_reuses_the_server(home: Path, url: str) -> None:
    pid = json.loads((home / "server.json").read_text())["pid"]
    started = time.monotonic()
    again = _python(ENSURE, _env(home))
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err[-3000:]
    assert out.strip().splitlines()[-1] == url
    assert json.loads((home / "server.json").read_text())["pid"] == pid and _servers_of(home) == [pid]
    assert time.monotonic() - started < 60  # no new server was waited for


def test_prefect_api_url_wins(tmp_path: Path) -> None:
    configured = "http://127.0.0.1:9/api"
    done = _python(ENSURE, _env(tmp_path / "unused", PREFECT_API_URL=configured))
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0, err[-3000:]
    assert out.strip().splitlines()[-1] == configured
    assert not (tmp_path / "unused" / "server.json").exists() and not _servers_of(tmp_path / "unused")


SLEEPY_FLOW = """
import sys, time
from prefect import flow, task
from prefect.runtime import flow_run
from runtime.flow_leases import LEASE_HOOKS, leased
from runtime.prefect_api import prefect_api

@task(name="k6vsr-test-nap")
def nap(seconds: float) -> None:
    time.sleep(seconds)

@flow(name="k6vsr-test-sleepy", **LEASE_HOOKS)
@leased
def sleepy(seconds: float) -> None:
    napping = nap.submit(seconds)
    print("RUN", flow_run.id, flush=True)
    napping.wait()

with prefect_api():
    sleepy(float(sys.argv[1]))
"""


def _task_states(client: Any, flow_run_id: str) -> list[str]:
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    runs = client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id])))
    return [run.state.name for run in runs if run.state is not None]


def test_a_killed_run_is_marked_crashed_by_the_next_command(home: Path, url: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    process = subprocess.Popen(
        [sys.executable, "-c", SLEEPY_FLOW, "120"],
        env=_env(home),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        run_id = ""
        for line in process.stdout:  # printed inside the flow, once its lease is held
            if line.startswith("RUN "):
                run_id = line.split()[1]
                break
        assert run_id, "the flow did not start"
        lease = home / "leases" / f"{run_id}.json"
        assert lease.is_file()
        with temporary_settings(updates={PREFECT_API_URL: url}), get_client(sync_client=True) as client:
            assert client.read_flow_run(UUID(run_id)).state.name == "Running"
            deadline = time.monotonic() + 60
            while _task_states(client, run_id) != ["Running"]:  # the task's state reaches the API as an event
                assert time.monotonic() < deadline, _task_states(client, run_id)
                time.sleep(0.2)
            process.kill()
            process.wait(timeout=30)
            assert client.read_flow_run(UUID(run_id)).state.name == "Running"  # nobody told the API
            nxt = _python(ENSURE, _env(home))
            _, err = nxt.communicate(timeout=120)
            assert nxt.returncode == 0, err[-3000:]
            state = client.read_flow_run(UUID(run_id)).state
            task_states = _task_states(client, run_id)
        assert state.name == "Crashed" and f"process {process.pid}" in state.message
        assert task_states == ["Crashed"]  # the task in flight, too
        assert not lease.exists()
    finally:
        if process.poll() is None:
            process.kill()


def test_a_lease_follows_the_local_server_to_another_port(home: Path, url: str) -> None:
    """The local server keeps its history when it restarts on another port: a lease taken before still counts."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Running

    @flow(name="k6vsr-test-lease")
    def nothing() -> None:
        pass

    with temporary_settings(updates={PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        run = client.create_flow_run(nothing, state=Running())
        dead = subprocess.Popen(["true"])
        dead.wait()
        lease = flow_leases.Lease(
            flow_run_id=str(run.id),
            pid=dead.pid,
            host=os.uname().nodename,
            api_url="http://127.0.0.1:1/api",  # the port the server had then
            api=f"local:{home.resolve()}",
            started_at="2026-01-01T00:00:00+00:00",
        )
        (home / "leases").mkdir(exist_ok=True)
        (home / "leases" / f"{run.id}.json").write_text(lease.model_dump_json())
        assert flow_leases.mark_crashed_runs(url, home) == [str(run.id)]
        assert client.read_flow_run(run.id).state.name == "Crashed"
    assert not (home / "leases" / f"{run.id}.json").exists()


def test_a_dead_run_s_subflow_left_pending_is_ended_with_it(home: Path, url: str) -> None:
    """A clip run created under an archive (Pending, its body not started, so no lease of its own) when the
    archive's process died: marked Crashed with the archive's run."""
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Pending, Running

    @flow(name="k6vsr-test-parent")
    def parent() -> None:
        pass

    @task(name="k6vsr-test-subflow-holder")
    def parent_task() -> None:
        pass

    with temporary_settings(updates={PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        run = client.create_flow_run(parent, state=Running())
        holder = client.create_task_run(parent_task, flow_run_id=run.id, dynamic_key="0", state=Running())
        child = client.create_flow_run(parent, parent_task_run_id=holder.id, state=Pending())
        dead = subprocess.Popen(["true"])
        dead.wait()
        lease = flow_leases.Lease(
            flow_run_id=str(run.id), pid=dead.pid, host=os.uname().nodename, api_url=url,
            api=f"local:{home.resolve()}", started_at="2026-01-01T00:00:00+00:00",
        )  # fmt: skip
        (home / "leases").mkdir(exist_ok=True)
        (home / "leases" / f"{run.id}.json").write_text(lease.model_dump_json())
        assert flow_leases.mark_crashed_runs(url, home) == [str(run.id)]
        assert client.read_flow_run(child.id).state.name == "Crashed"


@pytest.mark.parametrize("body", ["returns", "raises"])
def test_a_run_that_ends_leaves_no_lease(home: Path, url: str, body: str) -> None:
    script = SLEEPY_FLOW.replace("sleepy(float(sys.argv[1]))", "sleepy(0.0)")
    if body == "raises":
        script = script.replace("sleepy(0.0)", "sleepy(float('nan'))").replace("napping.wait()", "napping.result()")
    done = _python(script, _env(home))
    out, err = done.communicate(timeout=120)
    assert done.returncode == (0 if body == "returns" else 1), err[-3000:]
    run_id = next(line.split()[1] for line in out.splitlines() if line.startswith("RUN "))
    assert not (home / "leases" / f"{run_id}.json").exists()
    assert flow_leases.mark_crashed_runs(url, home) == []


# The server goes away between the body's end and the report of the run's final state: Prefect's client cannot set it.
UNREPORTED_END = SLEEPY_FLOW.replace(
    "with prefect_api():",
    """import os, httpx
import prefect.flow_engine as engine
proposed = engine.propose_state_sync

def propose(client, state, **kwargs):
    if state.is_final():
        request = httpx.Request("POST", os.environ["PREFECT_API_URL"] + "/flow_runs/set_state")
        raise httpx.ConnectError("All connection attempts failed", request=request)
    return proposed(client, state, **kwargs)

engine.propose_state_sync = propose
with prefect_api():""",
)


def test_a_run_whose_end_never_reached_the_api_keeps_its_lease_and_is_marked_crashed(home: Path, url: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    ended = _python(UNREPORTED_END.replace("sleepy(float(sys.argv[1]))", "sleepy(0.0)"), _env(home))
    out, err = ended.communicate(timeout=120)
    assert ended.returncode == 1 and "stopped answering" in err, err[-3000:]  # the lost API's line (api_loss)
    run_id = next(line.split()[1] for line in out.splitlines() if line.startswith("RUN "))
    assert (home / "leases" / f"{run_id}.json").is_file()
    with temporary_settings(updates={PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        assert client.read_flow_run(UUID(run_id)).state.name == "Running"  # the body ended; the API never heard
        assert flow_leases.mark_crashed_runs(url, home) == [run_id]
        assert client.read_flow_run(UUID(run_id)).state.name == "Crashed"
    assert not (home / "leases" / f"{run_id}.json").exists()


def test_a_leased_flow_without_the_lease_hooks_is_refused(home: Path, url: str) -> None:
    unhooked = _python(SLEEPY_FLOW.replace(", **LEASE_HOOKS)", ")").replace("sys.argv[1]", "0.0"), _env(home))
    _, err = unhooked.communicate(timeout=120)
    assert unhooked.returncode == 1 and "not declared with **LEASE_HOOKS" in err, err[-3000:]


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                children.setdefault(int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(
                    int(proc.name)
                )
            except (OSError, IndexError, ValueError):
                continue
    found, stack = set(), [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_killed_http_server_orphans_no_prefect_server(
    home: Path, url: str, tiny_bundle_path: Path, tmp_path: Path
) -> None:
    """`k6vsr serve` SIGKILLed: no process of its own survives but the Prefect server it used, the secured one that
    lasts in its store (the next `serve` on that store reuses it); the user's server is left alone."""
    import httpx

    servers = set(_servers_of(home))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve = subprocess.Popen(
        [sys.executable, "-m", "entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--store", str(tmp_path / "store"), "--model", str(tiny_bundle_path), "--device", "cpu"],
        env=_env(home), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert serve.poll() is None, "k6vsr serve exited"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        children = _descendants(serve.pid)
        serve.kill()
        serve.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        own = tmp_path / "store" / "prefect-server"
        assert prefect_server.server_status(own).running and prefect_server.server_auth(own)
        assert not [pid for pid in children if _alive(pid)], "a process of the killed server survived it"
        assert set(_servers_of(home)) == servers and prefect_server.server_status(home).running
    finally:
        if serve.poll() is None:
            serve.kill()
        prefect_server.stop_server(tmp_path / "store" / "prefect-server")


def test_server_command_stops_it_and_leaves_no_process(home: Path, url: str) -> None:
    cli = [sys.executable, "-m", "entrypoints.cli", "server"]
    status = procs.run([*cli, "status", "--json"], env=_env(home), cwd=ROOT)
    assert status.returncode == 0, status.stderr[-3000:]
    assert json.loads(status.stdout)["running"] is True
    stop = procs.run([*cli, "stop", "--json"], env=_env(home), cwd=ROOT)
    assert stop.returncode == 0, stop.stderr[-3000:]
    assert json.loads(stop.stdout)["stopped"] is True
    assert _servers_of(home) == [] and not (home / "server.json").exists()
    assert not prefect_server.server_status(home).running
    assert prefect_server.stop_server(home) is False


@pytest.fixture
def port_4200_taken() -> Iterator[None]:
    """Prefect's default port held, as by another server: the local server must start on another one."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", prefect_server.DEFAULT_PORT))
            sock.listen()
        except OSError:
            pass  # already taken by something else on this machine: just as good
        yield


def test_the_ui_is_told_its_api_on_whatever_port_the_server_gets(tmp_path: Path, port_4200_taken: None) -> None:
    """The UI asks `/ui-settings` where its API is: the port the server got, not 4200, even when the command runs
    with `PREFECT_API_URL` pointing at another server."""
    home = tmp_path / "server-home"
    env = _env(home, PREFECT_API_URL="http://127.0.0.1:9/api", PREFECT_UI_API_URL="http://127.0.0.1:9/api")
    env.pop("K6VSR_SERVER_PORT")  # Prefect's default port, 4200, which is taken
    cli = [sys.executable, "-m", "entrypoints.cli", "server"]
    try:
        start = procs.run([*cli, "start", "--json"], env=env, cwd=ROOT)
        assert start.returncode == 0, start.stderr[-3000:]
        status = json.loads(start.stdout)
        assert status["running"] and f":{prefect_server.DEFAULT_PORT}/" not in status["url"]
        with urllib.request.urlopen(f"{status['ui_url']}/ui-settings", timeout=30) as response:
            assert json.loads(response.read())["api_url"] == status["url"]
        # The port it got is kept: a restart asks for it again, so the UI keeps its address.
        assert (home / "port").read_text().strip() == status["url"].rsplit(":", 1)[1].removesuffix("/api")
        assert procs.run([*cli, "stop"], env=env, cwd=ROOT).returncode == 0
        again = procs.run([*cli, "start", "--json"], env=env, cwd=ROOT)
        assert again.returncode == 0, again.stderr[-3000:]
        assert json.loads(again.stdout)["url"] == status["url"]
    finally:
        prefect_server.stop_server(home)
        for pid in _servers_of(home):
            os.kill(pid, signal.SIGKILL)


def test_a_port_taken_since_is_replaced_and_remembered(tmp_path: Path) -> None:
    """The remembered port, taken by someone else since: another free one, remembered in its place."""
    folder = prefect_server.server_folder(tmp_path)
    folder.make()
    env = {key: value for key, value in os.environ.items() if key != "K6VSR_SERVER_PORT"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        (tmp_path / "port").write_text(f"{taken.getsockname()[1]}\n")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(os, "environ", env)
            port = prefect_server._pick_port(folder)
            assert port != taken.getsockname()[1] and (tmp_path / "port").read_text() == f"{port}\n"
            assert prefect_server._pick_port(folder) == port  # free: asked for again


CSRF_SEEN = """
from prefect.settings import get_current_settings
from runtime.prefect_api import prefect_api
with prefect_api():
    print(get_current_settings().client.csrf_support_enabled)
"""


def test_the_local_server_takes_sqlite_s_lock_at_begin_and_its_commands_ask_no_csrf_token(home: Path) -> None:
    """Launched through runtime.sqlite_writes; commands reporting to it skip the CSRF token it does not check, and
    commands reporting to a configured API keep Prefect's default."""
    ensured = _python(ENSURE, _env(home))  # the module's server, started again if a test before this one stopped it
    out, err = ensured.communicate(timeout=240)
    assert ensured.returncode == 0, err[-3000:]
    url = out.strip().splitlines()[-1]
    pid = json.loads((home / "server.json").read_text())["pid"]
    assert b"runtime.sqlite_writes" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    for extra, expected in (({}, "False"), ({"PREFECT_API_URL": url}, "True")):
        seen = _python(CSRF_SEEN, _env(home, **extra))
        out, err = seen.communicate(timeout=120)
        assert seen.returncode == 0, err[-3000:]
        assert out.strip().splitlines()[-1] == expected, extra


LOST_SERVER_FLOW = SLEEPY_FLOW.replace(
    """with prefect_api():
    sleepy(float(sys.argv[1]))
""",
    """from entrypoints.console import configure_terminal

configure_terminal(verbose=False)  # the terminal as the k6vsr command sets it up
try:
    with prefect_api():
        sleepy(3.0)
        sleepy(3.0)  # a second run, which needs the server
except Exception as err:
    print("ERROR", type(err).__name__, err, file=sys.stderr, flush=True)
""",
)


def test_a_local_server_killed_during_a_run_is_named_with_what_to_do(tmp_path: Path) -> None:
    """Not a bare `ConnectError` once the client's retries are spent (none here: the test does not wait a minute)."""
    home = tmp_path / "home"
    # Its run logs go to the API as a user's do: what could not be sent must not be written below the error.
    env = {**_env(home, PREFECT_CLIENT_MAX_RETRIES="0"), "PREFECT_LOGGING_TO_API_ENABLED": "true"}
    process = _python(LOST_SERVER_FLOW, env)
    try:
        seen = []
        for line in process.stdout:  # type: ignore[union-attr]
            seen.append(line)
            if line.startswith("RUN "):
                break
        else:
            raise AssertionError(f"the flow did not start: {seen} {process.communicate()[1][-3000:]}")
        (server,) = _servers_of(home)
        os.kill(server, signal.SIGKILL)
        _, err = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
        for pid in _servers_of(home):
            os.kill(pid, signal.SIGKILL)
    said = err.strip().splitlines()[-1]  # the last line
    assert said.startswith(f"ERROR ServerError the local Prefect server (state folder {home}) stopped answering")
    assert "rerun to resume, the next command starts the server again" in said


def test_only_the_api_s_own_connection_errors_are_named_as_its_loss() -> None:
    import httpx

    from runtime.api_loss import lost_api

    api = "http://127.0.0.1:4321/api"
    refused = httpx.ConnectError("[Errno 111] Connection refused", request=httpx.Request("GET", f"{api}/flow_runs/"))
    elsewhere = httpx.ConnectError("refused", request=httpx.Request("GET", "http://127.0.0.1:9000/bucket/key"))
    try:
        raise RuntimeError("the flow engine's own error") from refused
    except RuntimeError as wrapped:
        lost = lost_api(wrapped, api)
    assert lost is not None and str(lost).startswith(f"the Prefect API at {api} stopped answering during the run")
    assert lost_api(elsewhere, api) is None  # an object store's, a model download's: not the API's
    assert lost_api(httpx.ConnectError("no request"), api) is None
    assert lost_api(ValueError("bad"), api) is None
