"""Task runners: in-process threads by default, or Dask worker processes (local, GPU-pinned, or remote)."""

from __future__ import annotations

import importlib
from typing import Any

from prefect.task_runners import ThreadPoolTaskRunner


def uses_processes(workers: int, gpus: bool, dask_address: str | None) -> bool:
    return dask_address is not None or workers > 1 or gpus


def cluster_spec(workers: int, gpus: bool) -> tuple[str, dict[str, Any]]:
    """The local Dask cluster for tiles: one worker per GPU (dask-cuda pins each), or `workers` CPU processes."""
    if gpus:
        return "dask_cuda.LocalCUDACluster", {
            "threads_per_worker": 1,
            **({"n_workers": workers} if workers > 1 else {}),
        }
    return "distributed.LocalCluster", {
        "n_workers": workers,
        "processes": True,
        "threads_per_worker": 1,
        "dashboard_address": ":0",
    }


def start_cluster(workers: int, gpus: bool) -> Any:
    """A local cluster that outlives one flow (the archive shares one between its clips)."""
    path, kwargs = cluster_spec(workers, gpus)
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)(**kwargs)


def make_task_runner(workers: int = 1, dask_address: str | None = None, gpus: bool = False) -> Any:
    """One process per worker for `workers > 1`; threads (so a decode overlaps the next denoise) otherwise.

    With `gpus`, dask-cuda's LocalCUDACluster starts one worker per visible GPU (or `workers` of them), each pinned
    to its GPU; with `dask_address`, tiles go to an existing Dask scheduler, possibly spanning machines.
    """
    if not uses_processes(workers, gpus, dask_address):
        return ThreadPoolTaskRunner(max_workers=2)
    from prefect_dask import DaskTaskRunner

    if dask_address:
        return DaskTaskRunner(address=dask_address)
    cluster_class, cluster_kwargs = cluster_spec(workers, gpus)
    return DaskTaskRunner(cluster_class=cluster_class, cluster_kwargs=cluster_kwargs)
