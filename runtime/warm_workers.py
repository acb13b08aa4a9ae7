"""Warm workers: a Dask cluster that lasts, one worker per GPU (or N CPU workers), kept across flow runs and models.

`k6vsr workers start` runs a supervisor, detached in its own session, that holds a Dask scheduler and its workers
(each behind a nanny, which restarts a worker that dies). A worker loads a model on the first tile that needs it
and keeps it (`tasks.model_cache`, an LRU by model identity) for every later run. With `--model` every worker loads
it at start and, compiled on CUDA, runs every shape a default run compiles (`tasks.worker_preload`); the start
returns once every worker has done so, so that not even the first run pays for loading or compiling. Every command
that runs tiles and is given no `--workers`, `--gpus` or `--dask-address` sends them to these workers while they
run (`running_address`).

The state folder (`$K6VSR_WORKERS_HOME`, else `$K6VSR_STATE_HOME/workers`, else `$XDG_STATE_HOME/k6vsr/workers`)
holds:

    workers.json   the supervisor's pid, then (once every worker is up, and with `--model` has loaded and warmed it)
                   the scheduler's address, written atomically
    workers.log    what the supervisor, scheduler and workers print
    workers.lock   held while a command starts or stops them, so racing commands start one cluster

One worker per GPU is started as a plain `distributed` nanny with `CUDA_VISIBLE_DEVICES` set to its GPU, not through
dask-cuda (whose releases lag `distributed`'s and may not import against it). A worker computes one task at a time
(a GPU runs one stage at a time within its memory budget); the nanny's one-thread defaults for OpenMP and BLAS are
replaced by the worker's share of the cores, and its memory limit is off: a worker holding a model's pinned weights
must never be restarted for its size.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from k6vsr_core import settings
from k6vsr_core.errors import ParameterError
from runtime.cluster_start import started
from runtime.service_errors import WorkersError
from runtime.slots import CPU_THREADS, CPU_WORKER_RESOURCES, MODEL_WORKER_RESOURCES, MODEL_WORKER_SLOTS
from runtime.state_folder import LaunchFailed, StateFolder, now, state_home
from service.runs import ModelSpec
from storage.processes import alive, group_alive, process_start
from tasks.worker_preload import preload_ended

log = logging.getLogger("k6vsr.workers")

WARM_POLL_S = 2.0  # how long each worker is asked to wait for its preload before answering
STOP_TIMEOUT_S = 20.0
STOP_GRACE_S = 3.0  # `workers stop` answers within about this (the streaming issue asks for 5 s at most)
HOME_ENV = settings.env_name("workers_home")
HOST = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parent.parent


class WorkersRecord(BaseModel):
    pid: int
    process_start: int | None = None
    started_at: str
    workers: int
    gpus: list[str] = []  # the GPU of each worker, in order; empty for CPU workers
    model: str | None = None  # the ModelSpec (JSON) loaded at start, if any
    address: str | None = None  # set by the supervisor once every worker is up (and has loaded `model`)
    loading_since: str | None = None  # every worker is up and loading `model`, since then (no address yet)
    dashboard: str | None = None


class SupervisorArgs(BaseModel):
    home: str
    workers: int
    gpus: list[str] = []
    model: str | None = None


class WorkerInfo(BaseModel):
    name: str
    pid: int | None = None
    gpu: str | None = None
    models: list[str] = []
    loads: int = 0


class WorkersStatus(BaseModel):
    running: bool
    home: str
    log: str
    pid: int | None = None
    address: str | None = None
    dashboard: str | None = None
    started_at: str | None = None
    uptime_s: float | None = None
    workers: list[WorkerInfo] = []


# ------------------------------------------------------------------------------------------------ the folder


def workers_home() -> Path:
    return state_home(settings.read(settings.Workers).workers_home, "workers")


def _folder(home: Path | None) -> StateFolder:
    return StateFolder(home or workers_home(), "workers")


def _reachable(address: str, timeout: float = 1.0) -> bool:
    """The scheduler accepts a connection at `address` (tcp://host:port)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


# --------------------------------------------------------------------------------------------- the commands


def gpu_ids() -> list[str]:
    """The GPUs of this machine, as CUDA_VISIBLE_DEVICES names them (respecting an existing restriction)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [gpu for gpu in visible.split(",") if gpu.strip()]
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False)
        count = sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.TimeoutExpired):
        count = 0
    return [str(i) for i in range(count)]


def running_address(home: Path | None = None) -> str | None:
    """The scheduler of the running warm workers, or None; a record whose supervisor is gone is removed."""
    folder = _folder(home)
    record = folder.read(WorkersRecord)
    if record is None:
        return None
    if not alive(record.pid, record.process_start):
        with contextlib.suppress(OSError):
            with folder.locked():
                current = folder.read(WorkersRecord)
                if current is not None and not alive(current.pid, current.process_start):
                    folder.remove_record()
        return None
    if record.address is None or not _reachable(record.address):
        return None
    return record.address


def start_workers(
    workers: int = 0, gpus: bool = False, model_json: str | None = None, home: Path | None = None
) -> WorkersRecord:
    """Start the warm workers (or return the running ones): `workers` CPU workers, or one per GPU with `gpus`."""
    folder = _folder(home)
    with folder.locked():
        record = folder.read(WorkersRecord)
        if record is not None and alive(record.pid, record.process_start):
            if record.address is None:  # a start killed midway: its supervisor still comes up
                record = _wait_ready(folder, record)
            return record
        folder.remove_record()
        devices = gpu_ids() if gpus else []
        if gpus and not devices:
            raise ParameterError("--gpus: no GPU found (nvidia-smi -L lists none)")
        if gpus and workers:
            devices = devices[:workers]
        count = len(devices) if gpus else max(1, workers)
        record = _launch(folder, count, devices, model_json)
        return _wait_ready(folder, record)


def _launch(folder: StateFolder, count: int, devices: list[str], model_json: str | None) -> WorkersRecord:
    supervisor = SupervisorArgs(home=str(folder.path), workers=count, gpus=devices, model=model_json)
    argv = [sys.executable, "-m", "runtime.warm_workers", supervisor.model_dump_json()]
    env = dict(os.environ)
    # The supervisor runs from its state folder: the workers must import k6vsr wherever the command ran from.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    # The supervisor rewrites the record with its address once ready; the launcher writes it only if not yet done.
    fields = {"started_at": now(), "workers": count, "gpus": devices, "model": model_json}
    try:
        return folder.launch_recorded(argv, env, fields, WorkersRecord)
    except LaunchFailed as err:
        raise WorkersError(f"the warm workers could not be launched: {err}; see {folder.log_path}") from None


def _wait_ready(folder: StateFolder, record: WorkersRecord) -> WorkersRecord:
    """Until the supervisor writes its address: `K6VSR_WORKERS_START_TIMEOUT` for the workers to come up, then,
    with a model, `K6VSR_WORKERS_WARM_TIMEOUT` (loading the model and compiling a default run's shapes: about 3
    minutes on an H200 with an empty compile cache) from when they began to load it for every worker to load and
    warm it."""
    timeouts = settings.read(settings.Workers)
    deadline = time.monotonic() + timeouts.workers_start_timeout
    loading = False
    while time.monotonic() < deadline:
        found = folder.read(WorkersRecord)
        mine = found if found is not None and found.pid == record.pid else None
        if mine is not None and mine.address and _reachable(mine.address):
            return mine
        if mine is not None and mine.loading_since and not loading:
            loading = True
            elapsed = (datetime.now(UTC) - datetime.fromisoformat(mine.loading_since)).total_seconds()
            deadline = time.monotonic() + timeouts.workers_warm_timeout - max(0.0, elapsed)
        if not alive(record.pid, record.process_start):
            folder.remove_record()
            raise WorkersError(f"the warm workers exited while starting; {folder.log_path} ends:\n{folder.log_tail()}")
        time.sleep(0.2)
    _terminate(record)
    folder.remove_record()
    if loading:
        model = ModelSpec.model_validate_json(record.model).model if record.model else "the model"
        raise WorkersError(
            f"the warm workers started but did not load and warm {model} within {timeouts.workers_warm_timeout:g} s "
            f"(K6VSR_WORKERS_WARM_TIMEOUT), and were stopped; {folder.log_path} ends:\n{folder.log_tail()}"
        )
    raise WorkersError(
        f"the warm workers did not start within {timeouts.workers_start_timeout:g} s (K6VSR_WORKERS_START_TIMEOUT); "
        f"{folder.log_path} ends:\n{folder.log_tail()}"
    )


def wait_preloaded(address: str, count: int, stopping: Callable[[], bool]) -> dict[str, dict[str, Any]]:
    """Until each of the `count` workers at `address` has finished its preload (`tasks.worker_preload`: the model
    loaded and warmed, or failed to); their states by worker address, or {} when `stopping()` first."""
    from distributed import Client

    with Client(address, timeout=30, set_as_default=False) as client:
        while not stopping():
            try:
                states = client.run(preload_ended, WARM_POLL_S)
            except Exception:  # noqa: BLE001 - a worker lost mid-call is restarted by its nanny: ask again
                states = {}
                time.sleep(WARM_POLL_S)
            # A worker without a state was given no model (its preload sets one before it joins): nothing to wait for.
            if len(states) >= count and all(state is None or state["done"] for state in states.values()):
                return {address: state for address, state in states.items() if state is not None}
    return {}


def _terminate(record: WorkersRecord, timeout: float = STOP_TIMEOUT_S, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM the supervisor (it closes its workers) and give it `grace` seconds, then SIGKILL whatever of its
    session is left. The grace is short on purpose: a worker keeps nothing that is not in a run store already
    (every write there is atomic, every task idempotent), while closing GPU workers gracefully took 26 s on an H200."""
    if alive(record.pid, record.process_start):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(record.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and alive(record.pid, record.process_start):
            time.sleep(0.1)
    # The supervisor leads its process group: nannies and workers are in it, whatever became of the supervisor.
    if record.process_start is None or process_start(record.pid) in (None, record.process_start):
        deadline = time.monotonic() + timeout
        while group_alive(record.pid) and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(record.pid, signal.SIGKILL)
            time.sleep(0.1)


def stop_workers(home: Path | None = None) -> bool:
    """Stop the warm workers; False if none were running."""
    return _folder(home).stop(WorkersRecord, _terminate)


def workers_status(home: Path | None = None, ask_workers: bool = True) -> WorkersStatus:
    folder = _folder(home)
    base = WorkersStatus(running=False, home=str(folder.path), log=str(folder.log_path))
    address = running_address(folder.path)
    record = folder.read(WorkersRecord)
    if address is None or record is None:
        return base
    started = datetime.fromisoformat(record.started_at)
    status = base.model_copy(
        update={
            "running": True,
            "pid": record.pid,
            "address": address,
            "dashboard": record.dashboard,
            "started_at": record.started_at,
            "uptime_s": round((datetime.now(UTC) - started).total_seconds(), 1),
        }
    )
    if ask_workers:
        status.workers = _ask_workers(address)
    return status


def _ask_workers(address: str) -> list[WorkerInfo]:
    from distributed import Client

    from tasks.model_cache import cache_info

    with Client(address, timeout=10, set_as_default=False) as client:
        names = {addr: info.get("name") for addr, info in client.scheduler_info(n_workers=-1)["workers"].items()}
        # The CPU-lane workers hold no model: the status lists the model workers.
        models = [addr for addr, name in names.items() if not str(name).startswith(CPU_LANE_PREFIX)]
        infos = client.run(lambda: cache_info().model_dump(), workers=models)
    return sorted(
        (
            WorkerInfo(
                name=str(names.get(addr, addr)),
                pid=info["pid"],
                gpu=info["gpu"],
                models=info["loaded"],
                loads=len(info["loads"]),
            )
            for addr, info in infos.items()
        ),
        key=lambda worker: worker.name,
    )


# ------------------------------------------------------------------------------------------------ supervisor


def _worker_env(devices: list[str], index: int, count: int) -> dict[str, str]:
    """The worker's environment: its GPU, its share of the cores for OpenMP/BLAS (the nanny would say 1)."""
    cores = str(max(1, len(os.sched_getaffinity(0)) // count))
    env = {"OMP_NUM_THREADS": cores, "MKL_NUM_THREADS": cores, "OPENBLAS_NUM_THREADS": cores}
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = devices[index]
    return env


def worker_options(devices: list[str], index: int, count: int, model_json: str | None = None) -> dict[str, Any]:
    """The Nanny options of model worker `index` of `count`: its model slots and no thread more, so the process
    that holds the model only computes. Its preloads: the model (tasks.worker_preload), and the filter that drops a
    heartbeat its scheduler did not answer, which only says that the cluster's process is going
    (runtime.worker_quiet)."""
    env = _worker_env(devices, index, count) | (settings.child_env(warm_model=model_json) if model_json else {})
    return {
        "nthreads": MODEL_WORKER_SLOTS,
        "resources": MODEL_WORKER_RESOURCES,
        "memory_limit": 0,
        "host": HOST,
        "env": env,
        "preload": ["runtime.worker_quiet", "tasks.worker_preload"],
    }


# CPU-lane workers beside the model workers (blends, segments, the quality report): one per model worker unless
# set. Each has its own GIL, so two clips' blends and x264 encodes never queue behind one interpreter.
CPU_LANE_ENV = settings.env_name("cpu_lane_workers")
CPU_LANE_PREFIX = "cpu-lane-"


def cpu_lane_count(model_workers: int) -> int:
    return settings.read(settings.Workers).cpu_lane_workers or max(1, model_workers)


def cpu_lane_options(count: int, lanes: int) -> dict[str, Any]:
    """The Nanny options of a CPU-lane worker: no GPU (CUDA_VISIBLE_DEVICES empty: torch never touches a device
    there), no model to preload, its share of the cores."""
    cores = str(max(1, len(os.sched_getaffinity(0)) // (count + lanes)))
    env = {"OMP_NUM_THREADS": cores, "MKL_NUM_THREADS": cores, "OPENBLAS_NUM_THREADS": cores}
    env |= {"CUDA_VISIBLE_DEVICES": ""} | settings.child_env(warm_model=None)
    return {
        "nthreads": CPU_THREADS,
        "resources": CPU_WORKER_RESOURCES,
        "memory_limit": 0,
        "host": HOST,
        "env": env,
        "preload": ["runtime.worker_quiet", "tasks.worker_preload"],
    }


def make_cluster(devices: list[str], count: int, lanes: int | None = None, model_json: str | None = None) -> Any:
    """A local cluster of `count` model workers (one per GPU of `devices` when given; each loading `model_json` as
    it starts, when given) and `lanes` CPU-lane workers (default `cpu_lane_count`), with the settings above."""
    import dask
    from distributed import Nanny, Scheduler, SpecCluster

    lanes = cpu_lane_count(count) if lanes is None else lanes
    workers = {
        (f"gpu-{devices[i]}" if devices else f"cpu-{i}"): {
            "cls": Nanny,
            "options": worker_options(devices, i, count, model_json),
        }
        for i in range(count)
    }
    for i in range(lanes):
        workers[f"{CPU_LANE_PREFIX}{i}"] = {"cls": Nanny, "options": cpu_lane_options(count, lanes)}
    scheduler = {"cls": Scheduler, "options": {"host": HOST, "port": 0, "dashboard_address": f"{HOST}:0"}}
    # The nanny's defaults: OpenMP/BLAS on one thread (replaced per worker above) and malloc trimming at 64 KiB,
    # which turns off glibc's adaptive mmap threshold so every tile-sized buffer is mapped and faulted in anew.
    # A worker that dies is restarted by its nanny, which takes a while (imports, the model); the cluster must not
    # give up on it after its default 15 s and close the nanny, which would leave one worker fewer for good.
    settings = {"distributed.nanny.pre-spawn-environ": {}, "distributed.deploy.lost-worker-timeout": "7 days"}
    with dask.config.set(settings):
        return started(lambda: SpecCluster(workers=workers, scheduler=scheduler, name="k6vsr-workers"))


def gpu_cluster(n_workers: int = 0) -> Any:
    """One worker per GPU (or the first `n_workers`), each pinned by CUDA_VISIBLE_DEVICES: `--gpus` without
    dask-cuda, whose releases lag `distributed`'s."""
    devices = gpu_ids()
    if not devices:
        raise ParameterError("--gpus: no GPU found (nvidia-smi -L lists none)")
    devices = devices[:n_workers] if n_workers else devices
    return make_cluster(devices, len(devices))


def split_cluster(model_json: str | None = None) -> Any:
    """A command's own cluster (`runtime.runners.own_processes`): a model worker per GPU, or one on the CPU where
    none is found (K6VSR_LANES=processes), each loading `model_json` as it starts, beside the command's flow start
    and ingest, and the CPU-lane workers."""
    devices = gpu_ids()
    return make_cluster(devices, len(devices) or 1, model_json=model_json)


def _supervise(folder: StateFolder, count: int, devices: list[str], model_json: str | None) -> None:
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if model_json:
        os.environ.update(settings.child_env(warm_model=model_json))
    import dask

    # Read when a worker is lost, long after the cluster is made: set for the life of the supervisor.
    dask.config.set({"distributed.deploy.lost-worker-timeout": "7 days"})
    cluster = make_cluster(devices, count)
    everyone = len(cluster.worker_spec)  # the model workers and the CPU-lane workers
    try:
        cluster.wait_for_workers(everyone, timeout=settings.read(settings.Workers).workers_start_timeout)
        record = folder.read(WorkersRecord)
        pid, start = os.getpid(), process_start(os.getpid())
        record = WorkersRecord(
            pid=pid,
            process_start=start,
            started_at=record.started_at if record is not None and record.pid == pid else now(),
            workers=count,
            gpus=devices,
            model=model_json,
        )
        if model_json:
            # Ready only once every worker holds the model, warm: the first run must not pay for it.
            folder.write(record.model_copy(update={"loading_since": now()}))
            print(f"warm workers up: {count} loading {ModelSpec.model_validate_json(model_json).model}", flush=True)
            states = wait_preloaded(cluster.scheduler_address, everyone, lambda: stop)
            if stop:
                return
            _print_preloaded(states)
        record = record.model_copy(update={"address": cluster.scheduler_address, "dashboard": cluster.dashboard_link})
        folder.write(record)
        print(
            f"warm workers ready at {cluster.scheduler_address}: {count} model workers, "
            f"{everyone - count} CPU-lane workers",
            flush=True,
        )
        checked = time.monotonic()
        while not stop:
            time.sleep(0.5)
            if time.monotonic() - checked > 30:  # a nanny that gave up (its worker would not start): start it again
                checked = time.monotonic()
                if set(cluster.worker_spec) - set(cluster.workers):
                    # Scaling to the size it has is distributed's public way to start the missing workers again.
                    cluster.scale(len(cluster.worker_spec))
            current = folder.read(WorkersRecord)
            if current is not None and current.pid == pid and current.address is None:
                folder.write(record)  # the starting command wrote its own over ours: put ours back
    finally:
        with contextlib.suppress(Exception):
            cluster.close(timeout=STOP_TIMEOUT_S / 2)


def _print_preloaded(states: dict[str, dict[str, Any]]) -> None:
    for address, state in sorted(states.items()):
        if state["error"]:
            done = f"{state['error']} (its first tile loads the model again)"
        elif state["warmed"]:
            done = f"loaded and warmed {state['warmed']} shapes in {state['seconds']} s"
        else:
            done = f"loaded in {state['seconds']} s (not compiled: nothing to warm)"
        print(f"warm worker at {address}: {done}", flush=True)


def main(argv: list[str] | None = None) -> None:
    """The supervisor: `python -m runtime.warm_workers '<SupervisorArgs as JSON>'` (what `start_workers` runs)."""
    args = SupervisorArgs.model_validate_json((argv or sys.argv[1:])[0])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _supervise(_folder(Path(args.home)), args.workers, args.gpus, args.model)


if __name__ == "__main__":
    main()
