"""One way to run a planned clip, `run_clip`: for the command, the demo, the archive, an HTTP job and the deployment.

A clip's run is a flow run of `upscale_clip` (flows.upscale_clip) on a task runner, the tile runner: where its tiles
compute (`tile_runner` picks it for one clip; an archive passes the cluster its clips share). What else the run takes
from its starter, its name and an archive's shared queue, is its run context (`flows.clip_context`). It reports to
the Prefect API of its caller: inside a flow run, as its subflow; else the one `prefect_api` points at.

Every run reports to one Prefect API: `PREFECT_API_URL` when set, else the local server that lasts
(`runtime.prefect_server`), started on first use and left running so the UI keeps every run. Its address is handed to
every process the command starts through the environment: Dask workers would otherwise each look for their own.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, cast

from prefect import Flow
from prefect.context import FlowRunContext
from prefect.states import State
from prefect.task_runners import ThreadPoolTaskRunner

from flows.clip_context import STANDALONE, ClipRunContext, clip_run_context
from flows.upscale_clip import ClipSummary, clip_flow, upscale_clip
from k6vsr_core.contract.params import UpscaleParams
from runtime.flow_leases import leased
from runtime.prefect_api import prefect_api
from runtime.runners import make_task_runner, own_processes, split_runner
from service.runs import ModelSpec, PreparedRun, prepare_run
from storage import default_store_root
from tasks.worker_preload import preload_in_background

__all__ = ["ClipRun", "ClipRunContext", "prefect_api", "run_clip", "tile_runner", "upscale_request"]


@dataclass(frozen=True)
class ClipRun:
    """A clip's flow run that ended: its id and its summary, or the error it failed with."""

    flow_run_id: str
    outcome: ClipSummary | Exception

    def summary(self) -> ClipSummary:
        """The run's summary; raises the error it failed with."""
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


def tile_runner(
    model: ModelSpec,
    prepared: PreparedRun | None = None,
    workers: int = 1,
    gpus: bool = False,
    dask_address: str | None = None,
) -> Any:
    """Where one clip's tiles compute: the cluster given or asked for (`workers`, `gpus`), the warm workers while
    they run, else, for a clip with work left, a cluster of the run's own on a GPU machine (a model process that
    only computes, `runtime.runners.own_processes`) or this process's threads, the model loading beside the flow's
    start."""
    runner = make_task_runner(workers, dask_address, gpus)
    if isinstance(runner, ThreadPoolTaskRunner) and prepared is not None and not prepared.finished:
        if own_processes(model.device):
            return split_runner(model.model_dump_json())
        preload_in_background(model, prepared.plan)
    return runner


def run_clip(
    prepared: PreparedRun,
    output: str | None,
    model: ModelSpec,
    runner: Any = None,
    context: ClipRunContext = STANDALONE,
) -> ClipRun:
    """Run the clip flow on the plan `prepared` into `output` (None: beside the source), its tiles on `runner`
    (None: `tile_runner(model, prepared)`), in `context`; inside a flow run as its subflow, else reporting to
    `prefect_api()`. An interrupt, or the Prefect API gone, raises; a run that failed returns its error
    (`ClipRun.summary` raises it)."""
    flow = _clip_flow_on(runner if runner is not None else tile_runner(model, prepared))
    reporting = nullcontext() if FlowRunContext.get() is not None else prefect_api()
    with reporting, clip_run_context(context):
        # A state, as `return_state` asks; Prefect's overloads give a flow of unnamed parameters its result's type.
        state = cast("State[ClipSummary]", flow(prepared=prepared, output=output, model=model, return_state=True))
    flow_run_id = str(state.state_details.flow_run_id)
    try:
        return ClipRun(flow_run_id, state.result())
    except Exception as err:  # noqa: BLE001 - the run failed: its caller says why (an archive goes on)
        return ClipRun(flow_run_id, err)


_last_flow: tuple[Any, Flow[..., ClipSummary]] | None = None
_last_flow_lock = threading.Lock()


def _clip_flow_on(runner: Any) -> Flow[..., ClipSummary]:
    """`upscale_clip` on `runner`, made once per runner: an archive runs every clip on one, and a flow's options
    rebuild its parameters' schema (55 ms a clip)."""
    global _last_flow
    with _last_flow_lock:
        if _last_flow is None or _last_flow[0] is not runner:
            _last_flow = (runner, upscale_clip.with_options(task_runner=runner))
        return _last_flow[1]


@clip_flow("upscale-request")
@leased  # a run whose process is killed is marked Crashed by the next command
def upscale_request(
    source: str,
    output: str | None = None,
    params: UpscaleParams = UpscaleParams(),
    model: ModelSpec = ModelSpec(),
    store_root: str | None = None,
    latent_fps: str | None = None,
) -> ClipSummary:
    """Plan a clip from the request's fields and run it: what the `upscale-clip` deployment starts, where no caller
    planned the clip before (the clip's run is its subflow, its tiles where `tile_runner` picks as it starts)."""
    prepared = prepare_run(source, params, model, store_root or default_store_root(), latent_fps)
    return run_clip(prepared, output, model).summary()
