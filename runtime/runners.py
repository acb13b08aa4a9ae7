"""Task runners: the warm workers when they run, else in-process threads, or Dask worker processes on request."""

from __future__ import annotations

import importlib
import sys
from typing import Any, cast

from prefect.futures import PrefectFuture
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from k6vsr_core import settings, status
from runtime.slots import MODEL_SLOTS, WORKER_RESOURCES, WORKER_THREADS

# "off" runs tiles in the command's own process (or the cluster it asks for) even while warm workers run.
USE_WARM_ENV = settings.env_name("warm_workers")
# Where a command's tiles compute when nothing else is asked and no warm workers run: "auto" (a cluster of its own
# on a GPU machine, its threads elsewhere), "processes" or "threads".
LANES_ENV = settings.env_name("lanes")


def warm_address() -> str | None:
    """The running warm workers' scheduler (`k6vsr workers start`), unless K6VSR_WARM_WORKERS=off."""
    if not settings.read(settings.Workers).warm_workers:
        return None
    from runtime.warm_workers import running_address

    return running_address()


def resolve_address(workers: int, gpus: bool, dask_address: str | None) -> str | None:
    """The scheduler tiles go to: the one given, else the warm workers when nothing else is asked for and they run."""
    if dask_address or workers > 1 or gpus:
        return dask_address
    address = warm_address()
    if address:
        status.say(f"tiles run on the warm workers at {address} (k6vsr workers status)")
    return address


def own_processes(device: str) -> bool:
    """Whether a command that asks for no cluster and finds no warm workers starts one of its own for its tiles
    (`runtime.warm_workers.split_cluster`: a model process per GPU that only computes, CPU-lane processes beside
    it) rather than computing in its own threads. On a GPU machine it does unless K6VSR_LANES=threads: there the
    blends, segments and x264 encodes of its threads would share the GIL and cores of the process that drives the
    GPU."""
    setting = settings.read(settings.Workers).lanes
    if setting != "auto":
        return setting == "processes"
    from runtime.warm_workers import gpu_ids

    # A device named by number (`cuda:1`) keeps the command's threads: a model worker sees its own GPU alone.
    return device in ("auto", "cuda") and bool(gpu_ids())


def uses_processes(workers: int, gpus: bool, dask_address: str | None) -> bool:
    return dask_address is not None or workers > 1 or gpus


def is_dask_runner(runner: object) -> bool:
    """Whether a flow run's task runner is prefect-dask's. No such runner exists before prefect_dask is imported, so
    a run on threads answers without importing Dask (seconds) just to ask."""
    module = sys.modules.get("prefect_dask")
    return module is not None and isinstance(runner, module.DaskTaskRunner)


class CountedThreadPool(ThreadPoolTaskRunner):
    """Prefect's thread pool, saying how many threads it has (`threads`): Prefect's own keeps the count private."""

    def __init__(self, max_workers: int | None = None) -> None:
        super().__init__(max_workers=max_workers)
        self.threads = max_workers

    def duplicate(self) -> CountedThreadPool:
        return type(self)(self.threads)


def local_threads() -> TaskRunner[PrefectFuture[Any]]:
    """This process's threads, one per model slot (so a decode overlaps the next denoise): the clip flows' default
    runner, where no caller picks another."""
    return cast("TaskRunner[PrefectFuture[Any]]", CountedThreadPool(max_workers=MODEL_SLOTS))


def thread_count(runner: object) -> int | None:
    """A flow run's threads for tasks: the count of ours, else Prefect's setting for its default pool; None: a
    thread per task (Prefect's default pool is unbounded)."""
    if isinstance(runner, CountedThreadPool):
        return runner.threads
    from prefect.settings import get_current_settings

    return get_current_settings().tasks.runner.thread_pool_max_workers


def cluster_spec(workers: int, gpus: bool) -> tuple[str, dict[str, Any]]:
    """The local Dask cluster for tiles: one worker per GPU (pinned by CUDA_VISIBLE_DEVICES), or `workers` CPU
    processes."""
    if gpus:
        return "runtime.warm_workers.gpu_cluster", {"n_workers": workers if workers > 1 else 0}
    return "runtime.cluster_start.local_processes", {
        "n_workers": workers,
        "processes": True,
        "threads_per_worker": WORKER_THREADS,
        "resources": WORKER_RESOURCES,
        "dashboard_address": ":0",
        "preload": ["runtime.worker_quiet", "tasks.worker_preload"],
    }


def start_cluster(workers: int, gpus: bool) -> Any:
    """A local cluster that outlives one flow (the archive shares one between its clips)."""
    path, kwargs = cluster_spec(workers, gpus)
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)(**kwargs)


def split_runner(model_json: str) -> Any:
    """A Dask task runner on a cluster of the flow's own: a model process per GPU (or one on the CPU), loading the
    model as it starts, and CPU-lane processes."""
    from prefect_dask import DaskTaskRunner

    return DaskTaskRunner(cluster_class="runtime.warm_workers.split_cluster", cluster_kwargs={"model_json": model_json})


def make_task_runner(workers: int = 1, dask_address: str | None = None, gpus: bool = False) -> Any:
    """One process per worker for `workers > 1`; the warm workers when they run and nothing else is asked for;
    threads (so a decode overlaps the next denoise) otherwise (the command's own cluster: `split_runner`).

    With `gpus`, one worker per visible GPU (or `workers` of them), each pinned to its GPU
    (`runtime.warm_workers.gpu_cluster`); with `dask_address`, tiles go to an existing Dask scheduler, possibly
    spanning machines.
    """
    dask_address = resolve_address(workers, gpus, dask_address)
    if not uses_processes(workers, gpus, dask_address):
        return local_threads()
    from prefect_dask import DaskTaskRunner

    if dask_address:
        return DaskTaskRunner(address=dask_address)
    cluster_class, cluster_kwargs = cluster_spec(workers, gpus)
    return DaskTaskRunner(cluster_class=cluster_class, cluster_kwargs=cluster_kwargs)
