"""The orchestration's own cost at archive scale: N small clips through one real `k6vsr archive` run.

    nice -n 10 python bench/archive_scale.py --clips 20 [--fake-ms 5] [--kill-at K] [--work DIR] [--append]
        [--database postgresql+asyncpg://USER:PASSWORD@HOST:PORT/EMPTY_DATABASE]

What runs: a Prefect server (Prefect's own app, `prefect.server.api.server.create_app`, with its services, on a
SQLite database in the work folder, its write transactions taking the lock at BEGIN as the local server's do
(`runtime.sqlite_writes`; `K6VSR_BENCH_PREFECT_DEFAULTS=1` leaves Prefect's own, and the clients' CSRF setting),
or with `--database` on an empty PostgreSQL database) wrapped in one ASGI middleware that counts every HTTP
request, its answers other than a success and the server's milliseconds per route, and every message received on
a websocket (Prefect 3 clients send task-run states as events over `/api/events/in`) at the server;
then `k6vsr archive` as a subprocess pointed at it (`PREFECT_API_URL`), on N synthetic 64x64 clips (every fifth
122 frames long, so two windows of one tile; the others one frame, one window), the tiny random bundle on the CPU
and the bench-only stand-in for the networks (`bench/fake_model.py`), so the networks
cost a fixed few milliseconds and what is left is the orchestration: Prefect, the scheduler, the store, the
blend, the segments and the mux.

It reports, as JSON and a markdown table:

- wall seconds of the archive command, per clip and per window, with the stand-in's pauses taken out;
- Prefect API requests (HTTP and websocket messages) counted at the server, in all, per clip and per window, the
  most frequent routes; the probes below are sent with a header the counter leaves out;
- the database's size and its rows per table (flow runs, task runs, events, artifacts, logs);
- the RSS of the archive command and of the server, sampled every second (first, peak, last);
- the UI's answers during the run: the flow-run list (`POST /api/flow_runs/filter`, 50 newest) and one clip run's
  page (its flow run, its task runs, its graph), every few seconds, slowest and median;
- with `--kill-at K`: a second archive of fresh copies killed (SIGKILL) once K clips are done, resumed, and the
  resumed run's cost per skipped clip: (the resume's wall time - the wall time of a run of the remaining clips
  alone, measured on a third copy) / (K finished clips); and always a rerun of the finished archive, whose skip cost
  per clip is (its wall time - the wall time of a rerun of one of its clips) / (N - 1).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import fake_model  # noqa: E402 - after the checkout is on the path

PROBE_HEADER = "x-k6vsr-bench-probe"
LONG_EVERY = 5  # every fifth clip is two windows long
MAX_PARALLEL = 0  # --max-parallel: the archive's clips in flight (0: its default)

# The server: Prefect's app inside a counting middleware. Run as `python -c SERVER home port counts.json`.
SERVER = r"""
import json, os, re, sys, threading, time
from collections import Counter
home, port, counts_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
import uvicorn
if os.environ.get("K6VSR_BENCH_PREFECT_DEFAULTS") != "1":  # the local server's SQLite writes, as k6vsr runs them
    from runtime.sqlite_writes import take_write_lock_at_begin
    take_write_lock_at_begin()
from prefect.server.api.server import create_app
ids = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
counts = Counter()
lock = threading.Lock()

class Counting:
    def __init__(self, app):
        self.app = app
    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        probe = any(k == b"x-k6vsr-bench-probe" for k, _ in scope.get("headers", []))
        if kind not in ("http", "websocket") or probe:
            return await self.app(scope, receive, send)
        route = ids.sub("{id}", scope["path"])
        if kind == "http":
            key = f"{scope['method']} {route}"
            with lock:
                counts[f"http {key}"] += 1
            started = time.perf_counter()
            async def timed(message):
                if message["type"] == "http.response.start" and message["status"] >= 300:
                    with lock:
                        counts[f"answer {message['status']} {key}"] += 1
                return await send(message)
            try:
                return await self.app(scope, receive, timed)
            finally:
                with lock:  # seconds from the request to its answer's end, in milliseconds, over all of the route's
                    counts[f"ms {key}"] += round(1000 * (time.perf_counter() - started))
        with lock:
            counts[f"ws-open {route}"] += 1
        async def counted():
            message = await receive()
            if message["type"] == "websocket.receive":
                with lock:
                    counts[f"ws-msg {route}"] += 1
            return message
        return await self.app(scope, counted, send)

def dump():
    while True:
        time.sleep(1.0)
        with lock:
            data = dict(counts)
        partial = counts_path + ".partial"
        with open(partial, "w") as handle:
            json.dump(data, handle)
        os.replace(partial, counts_path)

threading.Thread(target=dump, daemon=True).start()
uvicorn.run(Counting(create_app(final=True)), host="127.0.0.1", port=port, log_level="warning")
"""


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(work: Path, database_url: str | None = None) -> tuple[subprocess.Popen, str, Path]:
    home = work / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    counts = work / "server-counts.json"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_UI_API_URL": f"http://127.0.0.1:{port}/api",
        "PYTHONPATH": str(ROOT),
    }
    env.pop("PREFECT_API_URL", None)
    if database_url:
        env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = database_url
    log = (work / "server.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(home), str(port), str(counts)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=work,
    )
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {(work / 'server.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return process, url, counts
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("the server did not answer within 180 s")


def read_counts(path: Path) -> dict[str, int]:
    time.sleep(1.5)  # the server writes its counts every second
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


FRAMES_FOR_WINDOWS = {1: 1, 2: 122, 3: 250}  # 121-frame windows, as the plan cuts them


def make_clips(folder: Path, n: int, windows_each: int = 0, size: tuple[int, int] = (64, 64)) -> tuple[int, int]:
    """N distinct clips (a tone of its own each, so a run key each), each `windows_each` windows long, or with 0
    every fifth two windows and the others one; returns (clips, windows)."""
    from k6vsr_core.media.sample import make_sample_clip

    folder.mkdir(parents=True, exist_ok=True)
    windows = 0
    for i in range(n):
        count = windows_each or (2 if i % LONG_EVERY == LONG_EVERY - 1 else 1)
        path = folder / f"clip-{i:05d}.mp4"
        if not path.exists():
            make_sample_clip(
                path, width=size[0], height=size[1], num_frames=FRAMES_FOR_WINDOWS[count], tone_hz=200.0 + 0.5 * i
            )
        windows += count
    return n, windows


def _request(url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[float, object]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    request.add_header("Content-Type", "application/json")
    request.add_header(PROBE_HEADER, "1")
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout) as response:
        payload = json.loads(response.read() or b"null")
    return time.perf_counter() - started, payload


class Sampler:
    """RSS of the archive command and the server every second; the UI's two pages every `ui_every` seconds."""

    def __init__(self, server_pid: int, api: str, ui_every: float = 5.0) -> None:
        self.server_pid, self.api, self.ui_every = server_pid, api, ui_every
        self.command_pid: int | None = None
        self.rss: dict[str, list[float]] = {"command": [], "server": []}
        self.ui: dict[str, list[float]] = {"flow_run_list": [], "flow_run_page": []}
        self.ui_errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _rss_mib(pid: int | None) -> float | None:
        import psutil

        if pid is None:
            return None
        try:
            process = psutil.Process(pid)
            return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]) / 2**20
        except psutil.Error:
            return None

    def _ui(self) -> None:
        try:
            seconds, runs = _request(
                f"{self.api}/flow_runs/filter", {"limit": 50, "sort": "START_TIME_DESC"}, timeout=30
            )
            self.ui["flow_run_list"].append(seconds)
            clips = [r for r in runs if r["name"].startswith("upscale-")]
            if not clips:
                return
            run_id = clips[0]["id"]
            started = time.perf_counter()
            _request(f"{self.api}/flow_runs/{run_id}")
            _request(f"{self.api}/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}, "limit": 200})
            _request(f"{self.api}/flow_runs/{run_id}/graph-v2")
            self.ui["flow_run_page"].append(time.perf_counter() - started)
        except Exception as err:  # noqa: BLE001 - a slow or failed answer is a finding, not a crash of the bench
            self.ui_errors.append(f"{type(err).__name__}: {err}"[:300])

    def _loop(self) -> None:
        last_ui = 0.0
        while not self._stop.wait(1.0):
            for name, pid in (("command", self.command_pid), ("server", self.server_pid)):
                rss = self._rss_mib(pid)
                if rss is not None:
                    self.rss[name].append(rss)
            if time.monotonic() - last_ui >= self.ui_every:
                last_ui = time.monotonic()
                self._ui()


def archive_command(inp: Path, out: Path, store: Path, bundle: Path) -> list[str]:
    extra = ["--max-parallel", str(MAX_PARALLEL)] if MAX_PARALLEL else []
    return [
        sys.executable,
        "-m",
        "entrypoints.cli",
        "archive",
        str(inp),
        "-o",
        str(out),
        "--model",
        str(bundle),
        "--device",
        "cpu",
        "--scale",
        "2",
        "--store",
        str(store),
        "--json",
        *extra,
    ]


def run_archive(
    command: list[str], env: dict[str, str], log: Path, sampler: Sampler | None = None, kill_when=None
) -> tuple[float, int]:
    """Wall seconds and exit code of one archive command; `kill_when()` true kills it (SIGKILL, its group)."""
    started = time.perf_counter()
    with log.open("w") as handle:
        process = subprocess.Popen(
            command, env=env, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
        if sampler is not None:
            sampler.command_pid = process.pid
        while process.poll() is None:
            if kill_when is not None and kill_when():
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                break
            time.sleep(0.2)
    if sampler is not None:
        sampler.command_pid = None
    return time.perf_counter() - started, process.returncode


def done_rows(out: Path) -> int:
    return sum(1 for row in manifest_rows(out) if row["status"] == "done")


def manifest_rows(out: Path) -> list[dict]:
    try:
        return json.loads((out / "k6vsr-archive-manifest.json").read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return []


def failed_rows(out: Path) -> dict[str, str]:
    return {row["relative_path"]: row["reason"][:300] for row in manifest_rows(out) if row["status"] == "failed"}


TABLES = ("flow_run", "task_run", "flow_run_state", "task_run_state", "events", "artifact", "log")


def postgres_database(url: str) -> dict[str, object]:
    """The PostgreSQL database's size and rows, as `database` gives them for SQLite."""
    import asyncio

    import asyncpg
    from sqlalchemy.engine import make_url

    parsed = make_url(url)

    async def read() -> dict[str, object]:
        db = await asyncpg.connect(
            host=parsed.host, port=parsed.port, user=parsed.username, password=parsed.password, database=parsed.database
        )
        try:
            rows: dict[str, int] = {}
            for table in TABLES:
                try:
                    rows[table] = await db.fetchval(f"select count(*) from {table}")  # noqa: S608 - fixed names
                except asyncpg.UndefinedTableError:
                    pass
            return {"bytes": await db.fetchval("select pg_database_size(current_database())"), "rows": rows}
        finally:
            await db.close()

    return asyncio.run(read())


def database(home: Path) -> dict[str, object]:
    files = [home / name for name in ("prefect.db", "prefect.db-wal", "prefect.db-shm")]
    size = sum(f.stat().st_size for f in files if f.exists())
    rows: dict[str, int] = {}
    with sqlite3.connect(f"file:{home / 'prefect.db'}?mode=ro", uri=True, timeout=30) as db:
        for table in TABLES:
            try:
                rows[table] = db.execute(f"select count(*) from {table}").fetchone()[0]  # noqa: S608 - fixed names
            except sqlite3.Error:
                pass
    return {"bytes": size, "rows": rows}


def summarise(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "n": len(values),
        "first": round(values[0], 3),
        "median": round(statistics.median(values), 3),
        "max": round(max(values), 3),
        "last": round(values[-1], 3),
    }


def _requests(counts: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in counts.items() if k.startswith(("http ", "ws-"))}


def _prefixed(counts: dict[str, int], prefix: str) -> dict[str, int]:
    return {k.removeprefix(prefix): v for k, v in counts.items() if k.startswith(prefix)}


def total(counts: dict[str, int], prefix: str = "") -> int:
    return sum(n for key, n in counts.items() if key.startswith(prefix))


def diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def _without_password(argv: list[str]) -> list[str]:
    from runtime import server_database

    return [server_database.masked(arg) if "://" in arg else arg for arg in argv]


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clips", type=int, default=20)
    parser.add_argument("--fake-ms", type=float, default=5.0)
    parser.add_argument("--kill-at", type=int, default=0, help="also kill a second archive at this clip and resume")
    parser.add_argument("--windows", type=int, default=0, choices=(0, 1, 2, 3), help="windows a clip (0: a mix)")
    parser.add_argument("--size", default="64x64", help="WIDTHxHEIGHT of every clip (64x64: one tile a window)")
    parser.add_argument("--max-parallel", type=int, default=0, help="the archive's clips in flight (default: its own)")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--append", action="store_true", help="append the table to bench/RESULTS.md")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument(
        "--database",
        default=None,
        metavar="URL",
        help="the server's database: an empty PostgreSQL one (postgresql+asyncpg://...); default SQLite in --work",
    )
    args = parser.parse_args(argv)
    global MAX_PARALLEL
    MAX_PARALLEL = args.max_parallel
    if args.database:
        from runtime import server_database

        args.database = server_database.parse_url(args.database)
        if args.database is not None:
            server_database.check_reachable(args.database)
            if postgres_database(args.database)["rows"].get("flow_run"):
                parser.error(f"--database {server_database.masked(args.database)} holds flow runs: give an empty one")

    from k6vsr_core.model.tiny_bundle import make_tiny_bundle

    work = args.work or Path(f"/tmp/k6vsr-archive-scale-{args.clips}")
    if work.exists() and not args.keep:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    bundle = work / "tiny"
    if not bundle.exists():
        make_tiny_bundle(bundle)
    width, height = (int(v) for v in args.size.split("x"))
    clips, windows = make_clips(work / "in", args.clips, args.windows, (width, height))

    server, api, counts_path = start_server(work, args.database)
    env = {
        **os.environ,
        "PREFECT_API_URL": api,
        "PREFECT_HOME": str(work / "client-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "K6VSR_SERVER_HOME": str(work / "k6vsr-server"),
        "K6VSR_WORKERS_HOME": str(work / "k6vsr-workers"),
        "K6VSR_WARM_WORKERS": "off",
        **fake_model.environment(args.fake_ms),
        "PYTHONPATH": str(ROOT),
    }
    if os.environ.get("K6VSR_BENCH_PREFECT_DEFAULTS") != "1":
        # As the command sets it for its own local server (runtime.prefect_api); this server has no CSRF either.
        env["PREFECT_CLIENT_CSRF_SUPPORT_ENABLED"] = "false"
    result: dict[str, object] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": os.environ.get("K6VSR_BENCH_COMMIT") or _commit(),
        "command": shlex.join(["python", "bench/archive_scale.py", *_without_password(argv or sys.argv[1:])]),
        "machine": f"{platform.node()}, {os.cpu_count()} cores",
        "clips": clips,
        "windows": windows,
        "size": args.size,
        "fake_ms": args.fake_ms,
        "database_kind": "postgresql" if args.database else "sqlite",
    }
    try:
        store = work / "store"
        out = work / "out"
        before = read_counts(counts_path)
        with Sampler(server.pid, api) as sampler:
            wall, rc = run_archive(archive_command(work / "in", out, store, bundle), env, work / "archive.log", sampler)
        after = read_counts(counts_path)
        failed = failed_rows(out)
        if rc != 0 and not failed:
            raise RuntimeError(f"the archive ended {rc}: {(work / 'archive.log').read_text()[-3000:]}")
        # The stand-in's pauses, at most: an encode a window, a denoise and a decode a tile (chunks hold 1+ tiles).
        items = sum(row.get("tiles") or 0 for row in manifest_rows(out))
        model_s = (windows + 2 * items) * args.fake_ms / 1000.0
        counts = diff(after, before)
        requests = total(counts, "http") + total(counts, "ws-msg")
        result["run"] = {
            "wall_s": round(wall, 2),
            "model_s": round(model_s, 3),
            "wall_per_clip_s": round((wall - model_s) / clips, 3),
            "wall_per_window_s": round((wall - model_s) / windows, 3),
            "http_requests": total(counts, "http"),
            "ws_messages": total(counts, "ws-msg"),
            "requests_per_clip": round(requests / clips, 2),
            "requests_per_window": round(requests / windows, 2),
            "top_routes": dict(sorted(_requests(counts).items(), key=lambda kv: -kv[1])[:12]),
            # The answers that were not a success (a 503: SQLite was busy, and the client waited about 2 s) and the
            # milliseconds the server took over each route, in all.
            "answers_not_ok": {k: v for k, v in counts.items() if k.startswith("answer ")},
            "server_ms_by_route": dict(sorted(_prefixed(counts, "ms ").items(), key=lambda kv: -kv[1])[:12]),
            "rss_command_mib": summarise(sampler.rss["command"]),
            "rss_server_mib": summarise(sampler.rss["server"]),
            # Every tenth sample (10 s apart), to see whether memory grows with the clips done.
            "rss_series_mib": {name: [round(v) for v in values[::10]] for name, values in sampler.rss.items()},
            "ui_flow_run_list_s": summarise(sampler.ui["flow_run_list"]),
            "ui_flow_run_page_s": summarise(sampler.ui["flow_run_page"]),
            "ui_errors": sampler.ui_errors[:5],
            "done": done_rows(out),
            "failed": failed,  # a failed clip is a finding (e.g. the server's 503 under load): its reason is kept
        }
        result["database"] = postgres_database(args.database) if args.database else database(work / "prefect-home")

        # A rerun of the finished archive: every clip is skipped.
        before = read_counts(counts_path)
        rerun, rc = run_archive(archive_command(work / "in", out, store, bundle), env, work / "rerun.log")
        rerun_counts = diff(read_counts(counts_path), before)
        # The same with one finished clip (a path list of it): the command's fixed cost, taken out of the above.
        one = work / "one.txt"
        one.write_text(f"{sorted((work / 'in').glob('*.mp4'))[0]}\n")
        rerun_one, rc_one = run_archive(archive_command(one, out, store, bundle), env, work / "rerun-one.log")
        result["rerun"] = {
            "wall_s": round(rerun, 2),
            "one_clip_wall_s": round(rerun_one, 2),
            "skip_per_clip_s": round((rerun - rerun_one) / max(1, clips - 1), 4),
            "requests": total(rerun_counts, "http") + total(rerun_counts, "ws-msg"),
            "rc": [rc, rc_one],
        }
        if args.kill_at:
            result["kill"] = kill_and_resume(args.kill_at, work, bundle, env, clips)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text)
    if args.append:
        with (ROOT / "bench" / "RESULTS.md").open("a") as handle:
            handle.write("\n" + table(result) + "\n")
    print(table(result))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def kill_and_resume(k: int, work: Path, bundle: Path, env: dict[str, str], clips: int) -> dict[str, object]:
    """A fresh archive of the same clips (a store and outputs of its own) killed once `k` clips are done, then
    resumed; the clips the resume had left are also run alone into a third store, to take their cost out."""
    store, out = work / "store-kill", work / "out-kill"
    wall, rc = run_archive(
        archive_command(work / "in", out, store, bundle), env, work / "kill.log", kill_when=lambda: done_rows(out) >= k
    )
    finished = done_rows(out)
    resume, resume_rc = run_archive(archive_command(work / "in", out, store, bundle), env, work / "resume.log")
    rows = json.loads((out / "k6vsr-archive-manifest.json").read_text())["rows"]
    reused = [row for row in rows if row["status"] == "reused"]
    ran = [row for row in rows if row["status"] == "done"]
    # The same clips the resume ran, alone: a path list of them into a store of their own.
    rest = work / "rest.txt"
    rest.write_text("".join(f"{row['source']}\n" for row in ran))
    alone, alone_rc = run_archive(
        archive_command(rest, work / "out-rest", work / "store-rest", bundle), env, work / "rest.log"
    )
    return {
        "killed_after_s": round(wall, 2),
        "done_when_killed": finished,
        "resume_wall_s": round(resume, 2),
        "resume_rc": resume_rc,
        "reused": len(reused),
        "ran": len(ran),
        "rest_alone_wall_s": round(alone, 2),
        "rest_alone_rc": alone_rc,
        "skip_cost_per_clip_s": round((resume - alone) / max(1, len(reused)), 3),
    }


def table(result: dict) -> str:
    run, db = result["run"], result["database"]
    lines = [
        f"## {result['date'][:10]} — archive at scale (#39): {result['clips']} clips, {result['windows']} windows, "
        f"{result.get('size', '64x64')}, stand-in {result['fake_ms']:g} ms"
        + (", on PostgreSQL" if result.get("database_kind") == "postgresql" else ""),
        "",
        f"Commit {result['commit']}, `{result['command']}`, {result['machine']}.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| archive wall s (stand-in's pauses at most {run['model_s']} s) | {run['wall_s']} |",
        f"| clips failed (reason) | {len(run.get('failed', {}))} {sorted(set(run.get('failed', {}).values()))[:1]} |",
        f"| wall s per clip / per window, outside model calls | {run['wall_per_clip_s']} / "
        f"{run['wall_per_window_s']} |",
        f"| API requests: HTTP / websocket messages | {run['http_requests']} / {run['ws_messages']} |",
        f"| API requests per clip / per window | {run['requests_per_clip']} / {run['requests_per_window']} |",
        f"| database bytes; rows | {db['bytes']:,}; " + ", ".join(f"{k} {v:,}" for k, v in db["rows"].items()) + " |",
        f"| RSS MiB, archive command: first / median / max / last | {_four(run['rss_command_mib'])} |",
        f"| RSS MiB, server: first / median / max / last | {_four(run['rss_server_mib'])} |",
        f"| UI flow-run list s: median / max (n) | {_ui(run['ui_flow_run_list_s'])} |",
        f"| UI one clip run's page s: median / max (n) | {_ui(run['ui_flow_run_page_s'])} |",
        f"| rerun of the finished archive: wall s (one clip of it: s); skip s per clip; requests | "
        f"{result['rerun']['wall_s']} ({result['rerun']['one_clip_wall_s']}); {result['rerun']['skip_per_clip_s']}; "
        f"{result['rerun']['requests']} |",
    ]
    if "kill" in result:
        kill = result["kill"]
        lines.append(
            f"| killed at {kill['done_when_killed']} done; resume wall s / the rest alone s; skip s per clip | "
            f"{kill['resume_wall_s']} / {kill['rest_alone_wall_s']}; {kill['skip_cost_per_clip_s']} |"
        )
    lines.append("")
    lines.append("Most frequent routes: " + ", ".join(f"`{k}` {v}" for k, v in run["top_routes"].items()) + ".")
    lines.append(
        "Answers other than a success: "
        + (", ".join(f"`{k.removeprefix('answer ')}` {v}" for k, v in run["answers_not_ok"].items()) or "none")
        + ". Server ms by route, in all: "
        + ", ".join(f"`{k}` {v}" for k, v in run["server_ms_by_route"].items())
        + "."
    )
    return "\n".join(lines)


def _four(s: dict) -> str:
    return " / ".join(str(round(s.get(k, 0), 1)) for k in ("first", "median", "max", "last")) if s else "n/a"


def _ui(s: dict) -> str:
    return f"{s['median']} / {s['max']} ({s['n']})" if s else "n/a"


if __name__ == "__main__":
    raise SystemExit(main())
