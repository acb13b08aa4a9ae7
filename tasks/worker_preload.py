"""The warm workers' preload (`dask worker --preload tasks.worker_preload`): load and warm the model at start.

`runtime.warm_workers` sets `K6VSR_WARM_MODEL` (a ModelSpec as JSON) when `k6vsr workers start --model` names one;
each worker then loads it in the background as it starts and, when the model runs compiled on CUDA, warms it: one
call of every shape a default run compiles (`k6vsr_core.contract.warm_plan`, `k6vsr_core.model.warmup`), with the
bundle placed
under the budget such a run gets, so the first run after the start compiles nothing. On a CPU nothing is compiled
and nothing is warmed. The supervisor asks every worker for `preload_state()` and reports the workers ready once
each has finished; a tile that comes sooner waits for the same load (the model cache holds its lock while loading).
Without a model, a worker loads each model on the first tile that needs it.

This module is imported by the command that starts the workers: torch is imported only inside the worker's thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

from pydantic import BaseModel

from k6vsr_core import settings
from k6vsr_core.contract.plan import ClipPlan
from service.runs import ModelSpec

# A ModelSpec as JSON, set by `runtime.warm_workers` for the workers it starts.
MODEL_ENV = settings.env_name("warm_model")
log = logging.getLogger("k6vsr.workers")


class PreloadState(BaseModel):
    """Where a worker's preload stands; `done` once it has loaded (and warmed) the model, or failed to."""

    model: str
    done: bool = False
    warmed: int = 0  # compiled shapes run by the warm-up; 0 when none ran
    seconds: float = 0.0  # load and warm-up
    error: str | None = None


_STATE: PreloadState | None = None


def preload_state() -> dict[str, Any] | None:
    """This worker's preload, as JSON-able data; None when no model was asked at start."""
    return None if _STATE is None else _STATE.model_dump()


async def preload_ended(within: float) -> dict[str, Any] | None:
    """`preload_state()` once the preload has ended, or after `within` seconds: on the worker's event loop (`Client.run`
    awaits a coroutine there), so a start asks each worker once per `within` seconds rather than polling it."""
    deadline = time.monotonic() + within
    while _STATE is not None and not _STATE.done and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return preload_state()


def warms(spec: ModelSpec) -> bool:
    """Whether a preload of `spec` warms it: only compiled networks compile per shape, and they compile on CUDA only."""
    import torch

    from tasks.model_cache import resolve_device

    return spec.compile and torch.device(resolve_device(spec.device)).type == "cuda"


def preload(spec: ModelSpec, state: PreloadState, plan: ClipPlan | None = None) -> None:
    """Load `spec` into the worker's model cache and, where it compiles, warm it for `plan` (default: the shapes a
    default run compiles); `state` says how it went."""
    from k6vsr_core.contract.warm_plan import warm_plan
    from k6vsr_core.model.bundle import model_traits
    from k6vsr_core.model.warmup import warm_up
    from tasks.model_cache import get_bundle

    started = time.perf_counter()
    pid = os.getpid()
    try:
        bundle = get_bundle(spec, plan)
        log.info("preload %d: loaded %s", pid, spec.model)
        if warms(spec):
            plan = plan or warm_plan(model_traits(bundle.info))
            # The preloaded bundle takes the budget a run of the plan gets: the decode's chunks come from it.
            warmed = warm_up(get_bundle(spec, plan), plan)
            state.warmed = warmed.shapes
            log.info("preload %d: warmed %d shapes in %.1f s", pid, warmed.shapes, warmed.seconds)
    except Exception as err:  # noqa: BLE001 - the first tile loads it again and reports the error to its run
        state.error = f"{type(err).__name__}: {err}"
        log.warning("preload %d: could not load or warm %s: %s", pid, spec.model, state.error)
    finally:
        state.seconds = round(time.perf_counter() - started, 1)
        state.done = True


def preload_in_background(spec: ModelSpec, plan: ClipPlan) -> PreloadState:
    """Load `spec` under `plan`'s budget, and warm it for the plan where it compiles, in a thread of this process:
    for a command whose tasks compute in its own threads, which then loads and warms the model while its flow
    starts and ingests the clip, instead of in its first encode, denoise and decode. A task that comes sooner waits
    for the same load (the model cache's lock), and a failed load is the first task's to report."""
    state = PreloadState(model=spec.model)
    threading.Thread(target=preload, args=(spec, state, plan), daemon=True, name="k6vsr-preload").start()
    return state


def _log_to_stderr() -> None:
    """k6vsr's lines of a worker into the workers' log (its stderr): Dask configures only its own loggers."""
    ours = logging.getLogger("k6vsr")
    if not ours.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)


def dask_setup(worker: Any) -> None:
    """Before the worker takes a task: the networks' modules imported in one thread (`import_networks`: its threads
    would otherwise import them at once), then the model's load begun in the background, when one is asked."""
    global _STATE
    from k6vsr_core.model.network_imports import import_networks

    import_networks()
    import tasks.model_cache  # noqa: F401 - imports the compiled paths' modules in this thread, before any task

    text = settings.read(settings.Workers).warm_model
    if text:
        _log_to_stderr()
        spec = ModelSpec.model_validate_json(text)
        _STATE = PreloadState(model=spec.model)
        threading.Thread(target=preload, args=(spec, _STATE), daemon=True, name="k6vsr-preload").start()
