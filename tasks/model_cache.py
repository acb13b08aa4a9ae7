"""One loaded model per worker process, kept for the life of the process, under one memory budget.

Tasks run in the flow's process (thread pool) or in Dask worker processes; either way the model is loaded once per
process and reused by every tile it runs. It lives in an importable module because functions defined in a flow
script are shipped by value to Dask workers, and a cache there would be rebuilt for every task.

The memory budget is chosen from the free memory of the worker's GPU as it was before the weights arrived, for the
first clip the worker runs (`k6vsr_core.memory.choose_budget`); a later clip must fit the same budget, or its stage
fails at once with the reason instead of running out of memory halfway.
"""

from __future__ import annotations

import logging
import threading

import torch

from k6vsr_core.bundle import ModelBundle, load_bundle
from k6vsr_core.memory import apply_budget, check_budget, choose_budget, free_gpu_bytes
from k6vsr_core.plan import ClipPlan
from service.runs import ModelSpec

_LOCK = threading.Lock()
_BUNDLES: dict[ModelSpec, ModelBundle] = {}
_FREE_BEFORE_LOAD: dict[ModelSpec, int | None] = {}
logger = logging.getLogger("k6vsr.memory")


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_bundle(spec: ModelSpec, plan: ClipPlan | None = None) -> ModelBundle:
    """The worker's bundle for `spec`, placed under the memory budget for `plan` (chosen at the first plan seen)."""
    with _LOCK:
        bundle = _BUNDLES.get(spec)
        if bundle is None:
            device = torch.device(resolve_device(spec.device))
            _FREE_BEFORE_LOAD[spec] = free_gpu_bytes(device)
            bundle = load_bundle(spec.model, spec.revision, model_id=spec.model_id, device=device)
            if spec.compile:
                from k6vsr_core.fast import compile_bundle

                compile_bundle(bundle)
            _BUNDLES[spec] = bundle
        if plan is not None:
            if bundle.memory is None:
                budget = choose_budget(spec.memory, _FREE_BEFORE_LOAD[spec], plan, device=str(bundle.device))
                apply_budget(bundle, budget)
                logger.info("memory: %s", budget.summary())
            else:
                check_budget(bundle.memory, plan)
        return bundle


def loaded_count() -> int:
    return len(_BUNDLES)


def clear() -> None:
    with _LOCK:
        _BUNDLES.clear()
        _FREE_BEFORE_LOAD.clear()
