"""A fleet on one machine: hosts that share nothing but a network and the object store, one archive across them.

    python bench/fleet_sim.py [--clips 20] [--faults link,store,kill] [--fake-ms 20] [--work DIR] [--keep] [--append]
    python bench/fleet_sim.py --clean     # what a run killed outright (no teardown) left

Needs root (network and mount namespaces). Every host is a network namespace of its own, joined to the others by a
bridge through a veth pair, on a private /24 that only these namespaces use, and every process of a host runs in a
mount namespace of its own where /tmp, /var/tmp and HOME (/home/fleet) are that host's own folders and /dev/shm a fresh
tmpfs: a host sees no other host's files (the checkout and its environment are the same on every host, as a fleet
installs them, and written by none: PYTHONDONTWRITEBYTECODE).

    prefect  Prefect server on PostgreSQL (both in this host)
    store    moto's S3 server, the bucket `media`
    control  Dask scheduler, and `k6vsr archive --store s3://media/store --dask-address tcp://control:8786`
    w1, w2   one `dask worker` each (CPU, the tiny bundle from a path of its own host), restarted when it exits
             (as a service manager would restart it: a worker that loses its scheduler exits)

Steps: the plain archive across the hosts; the same archive on the control host alone (local store, no Dask): every
output byte for byte the same; no file of a run on any host but the store; every clip's flow run completed in
Prefect. Then each fault in an archive of its own (a fresh store): a worker host's link down for longer than Dask's
timeouts and back up; the object store paused (SIGSTOP) for 30 s and resumed; a worker host killed whole. Each
finishes with the reference's bytes; the items a lost host had started and not finished, and any item whose record
was written twice, are counted from the workers' own logs (a Dask worker plugin and a hook on the record writes,
each written in the worker host's HOME).

Everything is torn down at the end, also on failure or Ctrl-C: every process of every namespace killed, the
namespaces and the bridge deleted, the work folder removed (unless --keep); each step bounded in time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import fake_model  # noqa: E402 - after the checkout is on the path

SUBNET = "10.213.77"
PREFIX = "k6fleet"  # namespaces: k6fleet-<pid>-<host>; links: k6f-<pid>-<n>, the bridge k6f-<pid>-br
HOSTS = {"prefect": 2, "store": 3, "control": 4, "w1": 11, "w2": 12}
WORKERS = ("w1", "w2")
PORTS = {"prefect": 4200, "store": 5000, "control": 8786}
BUCKET = "media"
HOME = "/home/fleet"  # every host's own folder (its HOME); /home is a fresh tmpfs in each
STORE_PAUSE_S = 30.0
LINK_DOWN_S = 45.0
# Dask's timeouts in the fleet, shorter than Dask's own defaults (a 30 s TCP timeout, a worker silent for 5 minutes
# removed) so that a cut-off host is noticed within a bench's time; the link stays down longer than all of them.
DASK_TIMEOUTS = {
    "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "10s",
    "DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": "15s",
    "DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL": "20s",
}
AWS = {
    "AWS_ACCESS_KEY_ID": "fleet",
    "AWS_SECRET_ACCESS_KEY": "fleet-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_ENDPOINT_URL": f"http://{SUBNET}.{HOSTS['store']}:{PORTS['store']}",
}

# Inside a host: its own folders as HOME and /tmp, a fresh /dev/shm, then the command. The folders are bound
# before /tmp is covered (the work folder, under the machine's /tmp, is then out of the host's sight). A checkout
# under /tmp (a CI clone in `mktemp -d`), with its virtualenv, is bound back at its own path ("$3"): every host runs
# the same install.
ENTER = """\
set -e
mount -t tmpfs -o size=1m,mode=755 fleet-home /home
mkdir /home/fleet /home/.checkout
mount --bind "$1" /home/fleet
if [ -n "$3" ]; then mount --bind "$3" /home/.checkout; fi
mount --bind "$2" /var/tmp
mount --bind "$2" /tmp
if [ -n "$3" ]; then mkdir -p "$3"; mount --bind /home/.checkout "$3"; fi
mount -t tmpfs -o size=512m,mode=1777 fleet-shm /dev/shm
shift 3
cd /home/fleet
exec "$@"
"""
# The checkout, where the hosts' own /tmp would hide it.
HIDDEN_CHECKOUT = str(ROOT) if any(ROOT.is_relative_to(top) for top in ("/tmp", "/var/tmp")) else ""

# Each worker's preload: every task it starts and ends, and every record it writes, one JSON line each in its own
# host's HOME (read by the bench after the run, from the machine's side).
AUDIT = """\
import json
import os
import time

from distributed import WorkerPlugin

from storage.records import RecordBook

os.makedirs(os.path.expanduser("~/fleet-audit"), exist_ok=True)
_LOG = open(os.path.expanduser("~/fleet-audit/%d.jsonl" % os.getpid()), "a", buffering=1)
_HOST = os.environ["K6VSR_FLEET_HOST"]


def _note(**line):
    _LOG.write(json.dumps({"t": time.time(), "host": _HOST, **line}) + "\\n")


class FleetAudit(WorkerPlugin):
    def transition(self, key, start, finish, **kwargs):
        if finish == "executing" or start == "executing":
            _note(event="task", key=str(key), start=start, finish=finish)


_plain_write = getattr(RecordBook.write, "plain", RecordBook.write)


def _write(self, stage, item, *args, **kwargs):
    record = _plain_write(self, stage, item, *args, **kwargs)
    _note(event="record", run=str(self.root), stage=stage, item=item)
    return record


_write.plain = _plain_write
RecordBook.write = _write


async def dask_setup(worker):
    await worker.plugin_add(FleetAudit(), name="fleet-audit")
"""

# Run inside the control host: every flow run and task run the Prefect API holds, with its flow's name and state.
PREFECT_RUNS = """\
import json, sys, urllib.request
api = sys.argv[1]
def post(path, body):
    request = urllib.request.Request(api + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.load(answer)
def every(path):
    found, offset = [], 0
    while True:
        page = post(path, {"limit": 200, "offset": offset, "sort": "EXPECTED_START_TIME_ASC"})
        found += page
        if len(page) < 200:
            return found
        offset += 200
flows = {f["id"]: f["name"] for f in post("/flows/filter", {"limit": 200})}
print(json.dumps({
    "flow_runs": [{"flow": flows.get(r["flow_id"]), "name": r["name"], "state": r["state_type"],
                   "created": r["created"]} for r in every("/flow_runs/filter")],
    "task_runs": [{"name": r["name"], "state": r["state_type"], "created": r["created"]}
                  for r in every("/task_runs/filter")],
}))
"""


# --------------------------------------------------------------------------------------------------- commands


def sh(*argv: str, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)}: {done.returncode} {done.stderr.strip()[-1000:]}")
    return done


def python_env(host: str, **extra: str) -> dict[str, str]:
    """A host's environment: nothing of this machine's but the checkout's interpreter and the locale."""
    return {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOME": HOME,
        "TMPDIR": "/tmp",
        "PYTHONPATH": str(ROOT),
        "PYTHONDONTWRITEBYTECODE": "1",
        "K6VSR_FLEET_HOST": host,
        "K6VSR_CPU_THREADS": "1",
        "K6VSR_WARM_WORKERS": "off",
        "PREFECT_HOME": f"{HOME}/.prefect",
        "PREFECT_API_URL": f"http://{SUBNET}.{HOSTS['prefect']}:{PORTS['prefect']}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_TO_API_ENABLED": "false",
        **AWS,
        **DASK_TIMEOUTS,
        **extra,
    }


# --------------------------------------------------------------------------------------------------- the fleet


@dataclass
class Host:
    name: str
    ns: str
    veth: str  # the machine's end of the host's link
    address: str
    folder: Path  # the machine's view of the host's disk: home/ (its HOME) and tmp/ (its /tmp)

    @property
    def home(self) -> Path:
        return self.folder / "home"

    @property
    def tmp(self) -> Path:
        return self.folder / "tmp"


@dataclass
class Fleet:
    """The namespaces, their links and the processes started in them; `down()` removes all of it."""

    work: Path
    tag: str = field(default_factory=lambda: str(os.getpid()))  # the names of a run whose process is gone are stale
    hosts: dict[str, Host] = field(default_factory=dict)
    processes: list[tuple[str, str, subprocess.Popen]] = field(default_factory=list)
    bridge: str = ""
    settings: dict[str, str] = field(default_factory=dict)  # for every host (the stand-in's, where chosen)

    def env(self, host: str, **extra: str) -> dict[str, str]:
        return python_env(host, **self.settings, **extra)

    def up(self) -> None:
        self.bridge = f"k6f-{self.tag}-br"
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "link", "set", self.bridge, "up")
        for name, last in HOSTS.items():
            host = Host(name, f"{PREFIX}-{self.tag}-{name}", f"k6f-{self.tag}-{last}", f"{SUBNET}.{last}",
                        self.work / "hosts" / name)  # fmt: skip
            self.hosts[name] = host
            for folder, mode in ((host.home, 0o755), (host.tmp, 0o1777)):
                folder.mkdir(parents=True)
                folder.chmod(mode)
            sh("ip", "netns", "add", host.ns)
            sh("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
            sh("ip", "link", "set", host.veth, "master", self.bridge, "up")
            inside = ("ip", "netns", "exec", host.ns, "ip")
            sh(*inside, "addr", "add", f"{host.address}/24", "dev", "eth0")
            sh(*inside, "link", "set", "eth0", "up")
            sh(*inside, "link", "set", "lo", "up")

    def argv(self, host: Host, command: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", host.ns, "unshare", "--mount", "--propagation", "private", "--",
                "sh", "-c", ENTER, "enter", str(host.home), str(host.tmp), HIDDEN_CHECKOUT, *command]  # fmt: skip

    def start(self, host: str, label: str, command: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
        where = self.hosts[host]
        log = (self.work / "logs" / f"{host}-{label}.log").open("ab")
        process = subprocess.Popen(self.argv(where, command), env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        log.close()
        self.processes.append((host, label, process))
        return process

    def run(self, host: str, command: Sequence[str], env: dict[str, str], timeout: float) -> str:
        """A command in a host to its end: its stdout (its stderr in the error where it fails)."""
        done = subprocess.run(self.argv(self.hosts[host], command), env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{host}: {shlex.join(command)[:300]} ended {done.returncode}: {done.stderr[-3000:]}")
        return done.stdout

    def reachable(self, source: str, target: str, port: int, timeout: float) -> None:
        """Wait until `target`'s port answers a TCP connection made from `source`'s network."""
        address = self.hosts[target].address
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            probe = ["ip", "netns", "exec", self.hosts[source].ns, "timeout", "2", "bash", "-c",
                     f"</dev/tcp/{address}/{port}"]  # fmt: skip
            if subprocess.run(probe, capture_output=True, timeout=10, check=False).returncode == 0:
                return
            time.sleep(0.5)
        raise RuntimeError(f"{target}:{port} did not answer {source} in {timeout:g} s; logs in {self.work / 'logs'}")

    def pids(self, host: str) -> list[int]:
        listed = sh("ip", "netns", "pids", self.hosts[host].ns, check=False).stdout.split()
        return [int(pid) for pid in listed]

    def kill_host(self, host: str, sig: signal.Signals = signal.SIGKILL, wait_s: float = 20.0) -> None:
        """Every process of the host's network namespace, whole: what a machine's power cut leaves."""
        deadline = time.monotonic() + wait_s
        while (pids := self.pids(host)) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            time.sleep(0.3)
        for name, _, process in self.processes:
            if name == host:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=5)

    def signal_all(self, host: str, sig: signal.Signals) -> None:
        for pid in self.pids(host):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def link(self, host: str, up: bool) -> None:
        sh("ip", "link", "set", self.hosts[host].veth, "up" if up else "down")

    def down(self) -> list[str]:
        """Kill every process, delete every namespace and the bridge; what could not be removed, if anything."""
        left: list[str] = []
        for host in self.hosts:
            with contextlib.suppress(Exception):
                self.signal_all(host, signal.SIGTERM)
        time.sleep(1.0)
        for host in self.hosts:
            try:
                self.kill_host(host, wait_s=15.0)
            except Exception as error:  # noqa: BLE001 - the rest must still be removed
                left.append(f"{host}: {error}")
            if self.pids(host):
                left.append(f"{host}: processes {self.pids(host)} still running")
        for _, _, process in self.processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        for host in self.hosts.values():
            sh("ip", "link", "del", host.veth, check=False)  # both ends: the kernel frees a namespace's later
            sh("ip", "netns", "del", host.ns, check=False)
        if self.bridge:
            sh("ip", "link", "del", self.bridge, check=False)
        deadline = time.monotonic() + 10.0
        while leftovers(self.tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left + leftovers(self.tag)


def leftovers(tag: str = "") -> list[str]:
    """Namespaces and links of this script still there: of one run's tag, or of every run."""
    namespaces = [line.split()[0] for line in sh("ip", "netns", "list").stdout.splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in sh("ip", "-o", "link").stdout.splitlines()]
    mark = f"{tag}-" if tag else ""
    found = [ns for ns in namespaces if ns.startswith(f"{PREFIX}-{mark}")]
    return found + [link for link in links if link.startswith(f"k6f-{mark}")]


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (ValueError, PermissionError):
        return True
    return True


def clean_stale() -> list[str]:
    """Remove what a run of this script killed outright (SIGKILL gives it no teardown) left: the namespaces and
    links of every run whose process is gone, with every process in those namespaces. Returns what it removed."""
    stale = {name.split("-")[1] for name in leftovers() if not _alive(name.split("-")[1])}
    removed = []
    for tag in sorted(stale):
        for name in leftovers(tag):
            if name.startswith(PREFIX):
                for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
                sh("ip", "netns", "del", name, check=False)
            else:
                sh("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed


@contextlib.contextmanager
def fleet(work: Path, settings: dict[str, str] | None = None) -> Iterator[Fleet]:
    """The fleet's namespaces, torn down whatever happens inside (an exception, Ctrl-C, SIGTERM)."""
    (work / "logs").mkdir(parents=True, exist_ok=True)
    made = Fleet(work, settings=settings or {})
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        made.up()
        yield made
    finally:
        left = made.down()
        signal.signal(signal.SIGTERM, previous)
        if left:
            print(f"fleet teardown left: {left}", file=sys.stderr)
        made.left = left  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------------- services


def start_prefect(hosts: Fleet, timeout: float = 240.0) -> None:
    """PostgreSQL (as its own user, on the host's loopback) and the Prefect server on it, on the host's address."""
    pg = hosts.hosts["prefect"].tmp / "pg"
    pg.mkdir()
    shutil.chown(pg, "postgres", "postgres")
    env = hosts.env("prefect")
    bindir = Path(shutil.which("pg_ctl") or "/usr/local/bin/pg_ctl").parent
    as_pg = ["runuser", "-u", "postgres", "--"]
    hosts.run("prefect", [*as_pg, str(bindir / "initdb"), "-D", "/tmp/pg/data", "-A", "trust", "-U", "k6vsr",
                          "-E", "UTF8", "--no-sync"], env, timeout=120)  # fmt: skip
    options = "-p 5432 -k /tmp/pg -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off"
    # pg_ctl leaves the server running in the host's namespaces and returns once it accepts connections.
    hosts.run("prefect", [*as_pg, str(bindir / "pg_ctl"), "-D", "/tmp/pg/data", "-l", "/tmp/pg/log", "-o", options,
                          "-w", "start"], env, timeout=120)  # fmt: skip
    env.update(
        PREFECT_SERVER_DATABASE_CONNECTION_URL="postgresql+asyncpg://k6vsr:unused@127.0.0.1:5432/postgres",
        PREFECT_UI_API_URL=env["PREFECT_API_URL"],
    )
    hosts.start("prefect", "server", [sys.executable, "-m", "prefect", "server", "start", "--host", "0.0.0.0",
                                      "--port", str(PORTS["prefect"])], env)  # fmt: skip
    hosts.reachable("control", "prefect", PORTS["prefect"], timeout)
    health = [sys.executable, "-c", "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)",
              env["PREFECT_API_URL"] + "/health"]  # fmt: skip
    deadline = time.monotonic() + timeout
    while True:
        try:
            hosts.run("control", health, hosts.env("control"), timeout=30)
            return
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def start_store(hosts: Fleet) -> subprocess.Popen:
    process = hosts.start("store", "moto", [sys.executable, "-m", "moto.server", "-H", "0.0.0.0", "-p",
                                            str(PORTS["store"])], hosts.env("store"))  # fmt: skip
    hosts.reachable("control", "store", PORTS["store"], 60)
    return process


def start_scheduler(hosts: Fleet) -> None:
    argv = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", hosts.hosts["control"].address,
            "--port", str(PORTS["control"]), "--no-dashboard"]  # fmt: skip
    hosts.start("control", "scheduler", argv, hosts.env("control"))
    hosts.reachable("control", "control", PORTS["control"], 60)


def start_worker(hosts: Fleet, name: str) -> None:
    """One `dask worker` on the host, started again a second after it exits, as a service manager would."""
    (hosts.hosts[name].home / "fleet_audit.py").write_text(AUDIT)
    scheduler = f"tcp://{hosts.hosts['control'].address}:{PORTS['control']}"
    worker = [sys.executable, "-m", "distributed.cli.dask_worker", scheduler, "--nthreads", "2", "--no-nanny",
              "--name", name, "--host", hosts.hosts[name].address, "--local-directory", "/tmp/dask",
              "--preload", f"{HOME}/fleet_audit.py"]  # fmt: skip
    loop = f"while :; do {shlex.join(worker)}; sleep 1; done"
    hosts.start(name, "worker", ["sh", "-c", loop], hosts.env(name))


def workers_connected(hosts: Fleet, count: int, timeout: float) -> None:
    check = (
        "import sys\nfrom distributed import Client\n"
        "with Client(sys.argv[1], timeout=30) as c:\n"
        "    c.wait_for_workers(int(sys.argv[2]), timeout=float(sys.argv[3]))"
    )
    scheduler = f"tcp://{hosts.hosts['control'].address}:{PORTS['control']}"
    hosts.run("control", [sys.executable, "-c", check, scheduler, str(count), str(timeout)], hosts.env("control"),
              timeout=timeout + 60)  # fmt: skip


def make_bucket(hosts: Fleet) -> None:
    code = "import boto3, sys; boto3.client('s3').create_bucket(Bucket=sys.argv[1])"
    hosts.run("control", [sys.executable, "-c", code, BUCKET], hosts.env("control"), timeout=60)


# --------------------------------------------------------------------------------------------------- inputs


FRAMES_FOR_WINDOWS = {1: 1, 2: 122}  # 121-frame windows, as the plan cuts them


def make_clips(folder: Path, n: int) -> dict[str, int]:
    """N distinct 64x64 clips, every fourth two windows long: their names and windows."""
    from k6vsr_core.media.sample import make_sample_clip

    folder.mkdir(parents=True)
    clips = {}
    for i in range(n):
        windows = 2 if i % 4 == 3 else 1
        name = f"clip-{i:03d}.mp4"
        make_sample_clip(folder / name, width=64, height=64, num_frames=FRAMES_FOR_WINDOWS[windows],
                         tone_hz=200.0 + i)  # fmt: skip
        clips[name] = windows
    return clips


def place_model(hosts: Fleet, bundle: Path) -> None:
    """The model on every host that resolves it, at the same path of the host's own disk (as each would download
    it): the control host plans with it, the workers compute with it."""
    for name in ("control", *WORKERS):
        shutil.copytree(bundle, hosts.hosts[name].home / "models" / "tiny")


# --------------------------------------------------------------------------------------------------- archives


def archive(hosts: Fleet, label: str, store: str, dask: bool, timeout: float) -> tuple[dict, float]:
    """`k6vsr archive` of the control host's clips into `~/out/<label>`: its JSON and wall seconds."""
    argv = [sys.executable, "-m", "entrypoints.cli", "archive", f"{HOME}/in", "-o", f"{HOME}/out/{label}",
            "--model", f"{HOME}/models/tiny", "--device", "cpu", "--scale", "2", "--store", store,
            "--json"]  # fmt: skip
    if dask:
        argv += ["--dask-address", f"tcp://{hosts.hosts['control'].address}:{PORTS['control']}"]
    started = time.monotonic()
    out = hosts.run("control", argv, hosts.env("control", K6VSR_WORKERS_READY_TIMEOUT="120"), timeout)
    return json.loads(out), time.monotonic() - started


def outputs(hosts: Fleet, label: str) -> dict[str, bytes]:
    folder = hosts.hosts["control"].home / "out" / label
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.mp4"))}


def differing(reference: dict[str, bytes], got: dict[str, bytes]) -> list[str]:
    return sorted(name for name in reference.keys() | got.keys() if reference.get(name) != got.get(name))


def prefect_runs(hosts: Fleet) -> dict[str, list[dict]]:
    env = hosts.env("control")
    return json.loads(hosts.run("control", [sys.executable, "-c", PREFECT_RUNS, env["PREFECT_API_URL"]], env, 180))


def prefect_view(runs: dict[str, list[dict]], since: str, clips: Sequence[str]) -> dict[str, object]:
    """What the Prefect UI shows of one archive (the runs created since `since`): the clips whose flow run
    completed, those with none, and its task runs by state (a task run whose host was lost stays as it was last
    reported)."""
    mine = [run for run in runs["flow_runs"] if run["created"] >= since and run["flow"] == "upscale-clip"]
    completed = {run["name"].removeprefix("upscale-") for run in mine if run["state"] == "COMPLETED"}
    states: dict[str, int] = {}
    for run in runs["task_runs"]:
        if run["created"] >= since:
            states[run["state"]] = states.get(run["state"], 0) + 1
    return {
        "clip_runs": len(mine),
        "completed": len(completed & set(clips)),
        "missing": sorted(set(clips) - completed),
        "task_runs_by_state": dict(sorted(states.items())),
    }


# --------------------------------------------------------------------------------------------------- checks


# What a host may hold beside the store, as each host sees it: its inputs, outputs and the archive manifest, the
# model, the workers' downloaded sources (k6vsr-sources) and Dask's, Prefect's, PostgreSQL's and this bench's own
# files. Anything else on a host's disk is a file of a run written outside the store.
ALLOWED = tuple(f"{HOME}/{name}" for name in ("in/", "out/", "models/", ".prefect/", "fleet-audit/", "fleet_audit.py"))
ALLOWED += ("/tmp/dask", "/tmp/k6vsr-sources/", "/tmp/pg/")


# Folders of the checkout that are no run's: its git and virtualenv, and the caches Python and the linters write
# (a fresh checkout's first imports, on any host or in a test beside the bench, compile its modules).
CACHES = frozenset({".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache"})


def files_outside_the_store(hosts: Fleet, since: float) -> dict[str, list[str]]:
    """Per host, every file on its disk (its HOME and /tmp) that is none of `ALLOWED`; and every file of the
    checkout (shared by the hosts, as the same install) changed since `since`. None is expected."""
    found: dict[str, list[str]] = {}
    for name, host in hosts.hosts.items():
        for top, seen_as in ((host.home, HOME), (host.tmp, "/tmp")):
            for path in top.rglob("*"):
                shown = f"{seen_as}/{path.relative_to(top)}"
                if path.is_file() and not shown.startswith(ALLOWED):
                    found.setdefault(name, []).append(shown)
    written = [
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*")
        if not CACHES.intersection(p.parts) and p.is_file() and p.stat().st_mtime > since
    ]
    if written:
        found["checkout"] = sorted(written)
    return found


def audit_lines(hosts: Fleet) -> list[dict]:
    lines = []
    for name in WORKERS:
        for log in (hosts.hosts[name].home / "fleet-audit").glob("*.jsonl"):
            for text in log.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    lines.append(json.loads(text))
    return lines


def recomputed(lines: list[dict], since: float, store: str) -> dict[str, object]:
    """From the workers' own logs, since `since`: tasks started on a host and never finished there (lost with it,
    run again elsewhere), and items of this store whose record was written more than once (computed twice)."""
    mine = [line for line in lines if line["t"] >= since]
    started: dict[tuple[str, str], int] = {}
    for line in mine:
        if line["event"] == "task":
            where = (line["host"], line["key"])
            started[where] = started.get(where, 0) + (1 if line["finish"] == "executing" else -1)
    lost = sorted(f"{host}: {key}" for (host, key), open_ in started.items() if open_ > 0)
    finished_keys = {key for (host, key), open_ in started.items() if open_ <= 0}
    writes: dict[tuple[str, str, str], list[str]] = {}
    for line in mine:
        if line["event"] == "record" and line["run"].startswith(store):
            writes.setdefault((line["run"], line["stage"], line["item"]), []).append(line["host"])
    twice = {f"{run.rsplit('/', 2)[-2][:12]} {stage} {item}": hosts_ for (run, stage, item), hosts_ in writes.items()
             if len(hosts_) > 1}  # fmt: skip
    by_host: dict[str, int] = {}
    for hosts_ in writes.values():
        for host in hosts_:
            by_host[host] = by_host.get(host, 0) + 1
    return {
        "records_written_by_host": by_host,
        "items": len(writes),
        "lost_tasks": lost,
        "lost_tasks_rerun_elsewhere": sum(key.split(": ", 1)[1] in finished_keys for key in lost),
        "records_written_twice": twice,
    }


# --------------------------------------------------------------------------------------------------- faults


def during(hosts: Fleet, label: str, store: str, timeout: float, fault) -> dict[str, object]:
    """An archive of a fresh store with `fault(hosts)` run beside it once the first records are written."""
    import threading

    notes: dict[str, object] = {}
    ready = threading.Event()

    def watch() -> None:
        # Wait for the workers' first finished items of this store, so that the fault lands mid-run.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not ready.is_set():
            if sum(line["event"] == "record" and line["run"].startswith(store) for line in audit_lines(hosts)) >= 4:
                break
            time.sleep(0.5)
        if not ready.is_set():
            started = time.monotonic()
            notes.update(fault(hosts) or {})
            notes["fault_s"] = round(time.monotonic() - started, 1)

    since = time.time()
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        result, wall = archive(hosts, label, store, True, timeout)
    finally:
        ready.set()
    thread.join(timeout=LINK_DOWN_S + STORE_PAUSE_S + 60)
    return {"result": result, "wall_s": round(wall, 1), "notes": notes, "since": since}


def cut_link(hosts: Fleet) -> dict[str, object]:
    hosts.link("w1", up=False)
    time.sleep(LINK_DOWN_S)
    hosts.link("w1", up=True)
    return {"host": "w1", "down_s": LINK_DOWN_S}


def pause_store(hosts: Fleet) -> dict[str, object]:
    hosts.signal_all("store", signal.SIGSTOP)
    try:
        time.sleep(STORE_PAUSE_S)
    finally:
        hosts.signal_all("store", signal.SIGCONT)
    return {"paused_s": STORE_PAUSE_S}


def kill_worker_host(hosts: Fleet) -> dict[str, object]:
    """The host gone at once, as a machine that loses its power: its link first, so that none of its connections
    is closed (no FIN or RST reaches the others: they find out by their timeouts), then all its processes."""
    hosts.link("w2", up=False)
    hosts.kill_host("w2")
    return {"host": "w2"}


FAULTS = {"link": cut_link, "store": pause_store, "kill": kill_worker_host}


# --------------------------------------------------------------------------------------------------- the bench


def _commit() -> str:
    return sh("git", "-C", str(ROOT), "rev-parse", "--short", "HEAD", check=False).stdout.strip()


def simulate(work: Path, clips_n: int, faults: Sequence[str], timeout: float, fake_ms: float) -> dict[str, object]:
    from k6vsr_core.model.tiny_bundle import make_tiny_bundle

    result: dict[str, object] = {}
    # The stand-in on every host alike: the run keys, and so the store's items, carry its mark.
    settings = fake_model.environment(fake_ms) if fake_ms > 0 else {}
    with fleet(work, settings) as hosts:
        began = time.monotonic()
        clips = make_clips(hosts.hosts["control"].home / "in", clips_n)
        place_model(hosts, make_tiny_bundle(work / "bundle"))
        start_store(hosts)
        start_scheduler(hosts)
        for name in WORKERS:
            start_worker(hosts, name)
        start_prefect(hosts)
        make_bucket(hosts)
        workers_connected(hosts, len(WORKERS), 180)
        result["fleet_up_s"] = round(time.monotonic() - began, 1)
        result["clips"], result["windows"] = len(clips), sum(clips.values())

        since, created = time.time(), datetime.now(UTC).isoformat()
        plain, wall = archive(hosts, "fleet", f"s3://{BUCKET}/store", True, timeout)
        result["fleet_archive"] = {"wall_s": round(wall, 1), "counts": plain["counts"]}
        result["files_outside_the_store"] = files_outside_the_store(hosts, since)
        result["prefect"] = prefect_view(prefect_runs(hosts), created, list(clips))
        result["fleet_archive"]["recomputed"] = recomputed(audit_lines(hosts), since, f"s3://{BUCKET}/store")

        reference, wall = archive(hosts, "one-host", f"{HOME}/one-host-store", False, timeout)
        result["one_host_archive"] = {"wall_s": round(wall, 1), "counts": reference["counts"]}
        expected = outputs(hosts, "one-host")
        result["outputs"] = len(expected)
        result["fleet_differs"] = differing(expected, outputs(hosts, "fleet"))

        for fault in faults:
            store = f"s3://{BUCKET}/store-{fault}"
            created = datetime.now(UTC).isoformat()
            ran = during(hosts, fault, store, timeout, FAULTS[fault])
            result[f"fault_{fault}"] = {
                "wall_s": ran["wall_s"],
                "counts": ran["result"]["counts"],
                "differs": differing(expected, outputs(hosts, fault)),
                **ran["notes"],
                "recomputed": recomputed(audit_lines(hosts), ran["since"], store),  # type: ignore[arg-type]
                "prefect": prefect_view(prefect_runs(hosts), created, list(clips)),
            }
            if fault == "link":
                workers_connected(hosts, len(WORKERS), 120)  # the cut-off host's worker is back
    result["left_behind"] = hosts.left  # type: ignore[attr-defined]
    return result


def failures(result: dict) -> list[str]:
    """What in `result` breaks the fleet's promises: an output differing from the one-host run's, a clip not done or
    without a completed flow run, a file written outside the store, a record written twice, anything left behind."""
    runs = {"fleet": result["fleet_archive"] | {"differs": result["fleet_differs"], "prefect": result["prefect"]}}
    runs |= {name: result[f"fault_{name}"] for name in FAULTS if f"fault_{name}" in result}
    found = []
    for name, run in runs.items():
        if run["differs"]:
            found.append(f"{name}: {len(run['differs'])} outputs differ from the one-host run's")
        if run["counts"].get("done", 0) + run["counts"].get("reused", 0) != result["clips"]:
            found.append(f"{name}: clips {run['counts']} of {result['clips']}")
        if run["prefect"]["missing"]:
            found.append(f"{name}: no completed flow run for {run['prefect']['missing']}")
        if twice := run.get("recomputed", {}).get("records_written_twice"):
            found.append(f"{name}: records written twice {twice}")
    if outside := {host: files for host, files in result["files_outside_the_store"].items() if files}:
        found.append(f"files written outside the store: {outside}")
    if result["left_behind"]:
        found.append(f"left behind: {result['left_behind']}")
    return found


def table(result: dict) -> str:
    networks = f" (its networks: the bench-only stand-in, {result['fake_ms']:g} ms a call)" if result["fake_ms"] else ""
    lines = [
        f"### A fleet on one machine ({result['date']}, commit {result['commit']})",
        "",
        f"`{result['command']}` on {result['machine']}: {result['clips']} clips ({result['windows']} windows), "
        f"the tiny bundle on the CPU{networks}, 5 network namespaces (Prefect+PostgreSQL, moto S3, control with "
        "the Dask scheduler and the archive, two Dask workers).",
        "",
        "| run | wall s | clips done | outputs differing from the one-host run | lost tasks (rerun elsewhere) | "
        "items written twice |",
        "|---|---|---|---|---|---|",
    ]
    runs = [("fleet, no fault", result["fleet_archive"], result["fleet_differs"])]
    runs += [(f"fault: {name}", result[f"fault_{name}"], result[f"fault_{name}"]["differs"])
             for name in FAULTS if f"fault_{name}" in result]  # fmt: skip
    for name, run, differs in runs:
        again = run.get("recomputed", {})
        lines.append(
            f"| {name} | {run['wall_s']} | {run['counts'].get('done', 0)} | {len(differs)} | "
            f"{len(again.get('lost_tasks', []))} ({again.get('lost_tasks_rerun_elsewhere', 0)}) | "
            f"{len(again.get('records_written_twice', {}))} |"
        )
    lines.append(f"| one host (reference) | {result['one_host_archive']['wall_s']} | "
                 f"{result['one_host_archive']['counts'].get('done', 0)} | - | - | - |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clips", type=int, default=20)
    parser.add_argument("--faults", default="link,store,kill", help="comma-separated of link, store, kill (or none)")
    parser.add_argument(
        "--fake-ms",
        type=float,
        default=20.0,
        help="the bench-only stand-in for the networks, ms a call (0: the tiny bundle's networks, ~100 s a window)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds an archive may take")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (the hosts' disks and logs)")
    parser.add_argument("--append", action="store_true", help="append the table to bench/RESULTS.md")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--clean", action="store_true", help="only remove what a killed run of this script left")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("the fleet's namespaces need root")
    if args.clean:
        print(json.dumps({"removed": clean_stale()}))
        return 0
    faults = [f for f in args.faults.split(",") if f and f != "none"]
    if unknown := set(faults) - set(FAULTS):
        parser.error(f"--faults: unknown {sorted(unknown)}; choose from {sorted(FAULTS)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="k6vsr-fleet-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "command": shlex.join(["python", "bench/fleet_sim.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": f"{platform.node()}, {os.cpu_count()} cores",
        "fake_ms": args.fake_ms,
    }
    try:
        result.update(simulate(work, args.clips, faults, args.timeout, args.fake_ms))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text)
    print(table(result))
    if args.append:
        with (ROOT / "bench" / "RESULTS.md").open("a") as handle:
            handle.write("\n" + table(result) + "\n")
    for failure in (broken := failures(result)):
        print(f"fleet_sim: FAILED: {failure}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
