"""Running a flow from an entry point: the Prefect API it reports to and the task runner.

Every run reports to one Prefect API: `PREFECT_API_URL` when set, else the local server that lasts
(`runtime.prefect_server`), started on first use and left running so the UI keeps every run. Its address is handed to
every process the command starts through the environment: Dask workers would otherwise each look for their own.
"""

from __future__ import annotations

from prefect.task_runners import ThreadPoolTaskRunner

from flows.upscale_clip import ClipSummary, upscale_clip
from runtime.prefect_api import prefect_api
from runtime.runners import make_task_runner, own_processes, split_runner
from service.runs import ModelSpec, PreparedRun
from tasks.worker_preload import preload_in_background

__all__ = ["prefect_api", "run_clip"]


def run_clip(
    prepared: PreparedRun,
    output: str,
    model: ModelSpec,
    workers: int = 1,
    gpus: bool = False,
    dask_address: str | None = None,
) -> ClipSummary:
    """Run the clip flow on the plan `prepared`, its tiles on threads or Dask workers, reporting to one Prefect API."""
    runner = make_task_runner(workers, dask_address, gpus)
    if isinstance(runner, ThreadPoolTaskRunner) and not prepared.finished:
        if own_processes(model.device):  # a model process that only computes, loading the model as it starts
            runner = split_runner(model.model_dump_json())
        else:  # the tiles compute here: load it beside the flow's start
            preload_in_background(model, prepared.plan)
    with prefect_api():
        return upscale_clip.with_options(task_runner=runner)(prepared=prepared, output=output, model=model)
