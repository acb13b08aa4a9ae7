"""Task runners: in-process threads by default, or Dask worker processes (local, GPU-pinned, or remote)."""

from __future__ import annotations

from typing import Any

from prefect.task_runners import ThreadPoolTaskRunner


def make_task_runner(workers: int = 1, dask_address: str | None = None, gpus: bool = False) -> Any:
    """One process per worker for `workers > 1`; threads (so a decode overlaps the next denoise) otherwise.

    With `gpus`, dask-cuda's LocalCUDACluster starts one worker per visible GPU (or `workers` of them), each pinned
    to its GPU; with `dask_address`, tiles go to an existing Dask scheduler, possibly spanning machines.
    """
    if dask_address is None and workers <= 1 and not gpus:
        return ThreadPoolTaskRunner(max_workers=2)
    from prefect_dask import DaskTaskRunner

    if dask_address:
        return DaskTaskRunner(address=dask_address)
    if gpus:
        kwargs: dict[str, Any] = {"threads_per_worker": 1}
        if workers > 1:
            kwargs["n_workers"] = workers
        return DaskTaskRunner(cluster_class="dask_cuda.LocalCUDACluster", cluster_kwargs=kwargs)
    return DaskTaskRunner(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={"n_workers": workers, "processes": True, "threads_per_worker": 1, "dashboard_address": ":0"},
    )
