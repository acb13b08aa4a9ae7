"""The loaded models of a worker process: a small LRU by model identity, under one memory budget per model.

Tasks run in the flow's process (thread pool) or in Dask worker processes, including the warm workers that outlive
flow runs (`flows.warm_workers`); either way a model is loaded once per process and reused by every tile it runs. It
lives in an importable module because functions defined in a flow script are shipped by value to Dask workers, and a
cache there would be rebuilt for every task.

A warm worker sees several models over its life (a distilled and a full one, another revision), so it keeps the
`K6VSR_MODEL_CACHE_SIZE` (default 2) most recently used: switching back and forth between two models costs no load,
and a third evicts the least recently used, whose weights are freed (host memory and the GPU's cache) before the
new one is loaded, so two models never exceed what the budget of each assumed for long.

The memory budget is chosen from the free memory of the worker's GPU as it was before the weights arrived, for the
first clip the worker runs with that model (`k6vsr_core.memory.choose_budget`); a later clip must fit the same
budget, or its stage fails at once with the reason instead of running out of memory halfway.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections import OrderedDict

import torch
from pydantic import BaseModel

from k6vsr_core.bundle import ModelBundle, load_bundle
from k6vsr_core.fast import compile_bundle
from k6vsr_core.memory import apply_budget, check_budget, choose_budget, free_gpu_bytes
from k6vsr_core.plan import ClipPlan
from service.runs import ModelSpec

SIZE_ENV = "K6VSR_MODEL_CACHE_SIZE"
DEFAULT_SIZE = 2

_LOCK = threading.Lock()
_BUNDLES: OrderedDict[ModelSpec, ModelBundle] = OrderedDict()  # least recently used first
_FREE_BEFORE_LOAD: dict[ModelSpec, int | None] = {}
_LOADS: list[str] = []  # every load of this process, in order (what `cache_info` reports)
logger = logging.getLogger("k6vsr.memory")


class CacheInfo(BaseModel):
    pid: int
    gpu: str | None  # CUDA_VISIBLE_DEVICES of the process, as its worker was started with
    size: int
    loaded: list[str]  # model identities kept, least recently used first
    loads: list[str]  # every model loaded by this process, in order (a reload shows twice)


def cache_size() -> int:
    try:
        return max(1, int(os.environ.get(SIZE_ENV, DEFAULT_SIZE)))
    except ValueError:
        return DEFAULT_SIZE


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _identity(spec: ModelSpec) -> str:
    return f"{spec.model_id or spec.model}@{spec.revision or ''}{'' if spec.compile else ' eager'} on {spec.device}"


def _evict_to(size: int) -> None:
    """Drop the least recently used models until `size` are kept, and give their memory back now."""
    evicted = False
    while len(_BUNDLES) > size:
        spec, _bundle = _BUNDLES.popitem(last=False)
        _FREE_BEFORE_LOAD.pop(spec, None)
        logger.info("model cache: evicted %s", _identity(spec))
        evicted = True
    if evicted:
        del _bundle
        gc.collect()  # the bundle's modules hold reference cycles: free their tensors before the next load
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def get_bundle(spec: ModelSpec, plan: ClipPlan | None = None) -> ModelBundle:
    """The worker's bundle for `spec`, placed under the memory budget for `plan` (chosen at the first plan seen)."""
    with _LOCK:
        bundle = _BUNDLES.get(spec)
        if bundle is None:
            _evict_to(cache_size() - 1)  # before loading: the new weights need the room
            device = torch.device(resolve_device(spec.device))
            _FREE_BEFORE_LOAD[spec] = free_gpu_bytes(device)
            bundle = load_bundle(spec.model, spec.revision, model_id=spec.model_id, device=device)
            # On CUDA always: eager NABLA without it would build the whole attention matrix (k6vsr_core.fast).
            compile_bundle(bundle, compiled=spec.compile)
            _BUNDLES[spec] = bundle
            _LOADS.append(_identity(spec))
        _BUNDLES.move_to_end(spec)
        if plan is not None:
            if bundle.memory is None:
                free = _FREE_BEFORE_LOAD[spec]
                overlap = stages_at_once() > 1
                budget = choose_budget(spec.memory, free, plan, device=str(bundle.device), overlap=overlap)
                apply_budget(bundle, budget)
                logger.info("memory: %s", budget.summary())
            else:
                check_budget(bundle.memory, plan)
        return bundle


# Threads of the flow's own task runner (flows.runners): a decode overlaps the next denoise in the command's process.
FLOW_THREADS = 2


def stages_at_once() -> int:
    """How many stage tasks this process may run at once: a Dask worker's threads (one, for k6vsr's workers), else
    the flow's two threads. With one, a decode never runs beside a denoise and the budget gives it that memory."""
    try:
        from distributed import get_worker

        return int(get_worker().state.nthreads)
    except (ImportError, ValueError, AttributeError):  # ValueError: not in a Dask worker
        return FLOW_THREADS


def cache_info() -> CacheInfo:
    """What this process keeps and has loaded (the warm workers' status and tests ask every worker for it)."""
    with _LOCK:
        return CacheInfo(
            pid=os.getpid(),
            gpu=os.environ.get("CUDA_VISIBLE_DEVICES"),
            size=cache_size(),
            loaded=[_identity(spec) for spec in _BUNDLES],
            loads=list(_LOADS),
        )


def clear() -> None:
    with _LOCK:
        _evict_to(0)
        _FREE_BEFORE_LOAD.clear()
