"""The loaded models of a worker process: a small LRU by model identity, under one memory budget per model.

Tasks run in the flow's process (thread pool) or in Dask worker processes, including the warm workers that outlive
flow runs (`runtime.warm_workers`); either way a model is loaded once per process and reused by every tile it runs. It
lives in an importable module because functions defined in a flow script are shipped by value to Dask workers, and a
cache there would be rebuilt for every task.

A warm worker sees several models over its life (a distilled and a full one, another revision), so it keeps the
`K6VSR_MODEL_CACHE_SIZE` (default 2) most recently used: switching back and forth between two models costs no load,
and a third evicts the least recently used, whose weights are freed (host memory and the GPU's cache) before the
new one is loaded, so two models never exceed what the budget of each assumed for long.

Each clip's memory budget is `k6vsr_core.model.memory.budget_for`: a function of the memory mode, the card and the
clip's
plan, the same in every process, never of the free memory, the thread count or the clip this worker ran before. A
loaded bundle is placed under one budget, so the cache keys it by model and budget: a clip whose budget differs
from the one of the bundle in hand gets a bundle of its own (loaded once, then kept like another model).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import warnings
from collections import OrderedDict

import torch
from pydantic import BaseModel

from k6vsr_core import settings, status
from k6vsr_core.contract.plan import ClipPlan
from k6vsr_core.device.memory_modes import BudgetName
from k6vsr_core.device.precision import check_precision
from k6vsr_core.model.bundle import ModelBundle, load_bundle
from k6vsr_core.model.fast import compile_bundle
from k6vsr_core.model.memory import GIB, apply_budget, budget_for, free_gpu_bytes
from k6vsr_core.model.network_imports import import_networks
from service.runs import ModelSpec

SIZE_ENV = settings.env_name("model_cache_size")

_LOCK = threading.Lock()
# Keyed by model and the name of the memory budget it is placed under (None: none yet, or no GPU to budget).
CacheKey = tuple[ModelSpec, BudgetName | None]
_BUNDLES: OrderedDict[CacheKey, ModelBundle] = OrderedDict()  # least recently used first
_FREE_BEFORE_LOAD: dict[CacheKey, int | None] = {}
_LOADS: list[str] = []  # every load of this process, in order (what `cache_info` reports)
logger = logging.getLogger("k6vsr.memory")


class CacheInfo(BaseModel):
    pid: int
    gpu: str | None  # CUDA_VISIBLE_DEVICES of the process, as its worker was started with
    size: int
    loaded: list[str]  # model identities kept, least recently used first
    loads: list[str]  # every model loaded by this process, in order (a reload shows twice)


def cache_size() -> int:
    return settings.read(settings.Workers).model_cache_size


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _identity(key: CacheKey) -> str:
    spec, budget = key
    placed = f" ({budget})" if budget is not None else ""
    eager = "" if spec.compile else " eager"
    revision = f"@{spec.revision}" if spec.revision else ""  # a local folder or the pinned release: no "@"
    return f"{spec.model_id or spec.model}{revision}{eager} on {spec.device}{placed}"


def _evict_to(size: int) -> None:
    """Drop the least recently used models until `size` are kept, and give their memory back now."""
    evicted = False
    while len(_BUNDLES) > size:
        key, _bundle = _BUNDLES.popitem(last=False)
        _FREE_BEFORE_LOAD.pop(key, None)
        logger.info("model cache: evicted %s", _identity(key))
        evicted = True
    if evicted:
        del _bundle
        gc.collect()  # the bundle's modules hold reference cycles: free their tensors before the next load
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def get_bundle(spec: ModelSpec, plan: ClipPlan | None = None) -> ModelBundle:
    """The worker's bundle for `spec`, placed under the memory budget of `plan` (without one: loaded, not placed)."""
    import_networks()
    with _LOCK:
        device = torch.device(resolve_device(spec.device))
        # Keyed by the device it resolves to: a worker preloaded for `cpu` (or `cuda`) serves a command's `auto`
        # with the same bundle instead of loading a second copy.
        spec = spec.model_copy(update={"device": str(device)})
        if plan is None:
            # A preload: any bundle of this model will do, the next plan places it (or loads one of its own).
            key = next((k for k in reversed(_BUNDLES) if k[0] == spec), (spec, None))
            return _cached(key, device)
        # Before any weights move: a precision this device cannot run is the user's to change.
        check_precision(plan.params.precision, device)
        budget = budget_for(spec.memory, device, plan)
        key = (spec, budget.budget)
        unplaced = _BUNDLES.get((spec, None))
        if key not in _BUNDLES and unplaced is not None and unplaced.memory is None:
            # The preloaded bundle takes this plan's budget.
            _BUNDLES[key] = _BUNDLES.pop((spec, None))
            _FREE_BEFORE_LOAD[key] = _FREE_BEFORE_LOAD.pop((spec, None), None)
        bundle = _cached(key, device)
        if bundle.memory is None:
            apply_budget(bundle, budget)
            logger.info("memory: %s", budget.summary())
            free = _FREE_BEFORE_LOAD.get(key)
            if free is not None and budget.estimate is not None and free < budget.estimate:
                logger.warning(
                    "memory: %.1f GiB were free on %s before the model loaded, the budget expects about %.1f GiB: "
                    "another process uses this GPU, and this one may run out of memory",
                    free / GIB,
                    device,
                    budget.estimate / GIB,
                )
        return bundle


def _cached(key: CacheKey, device: torch.device) -> ModelBundle:
    """The bundle kept under `key`, else one loaded now (the least recently used evicted first)."""
    spec = key[0]
    bundle = _BUNDLES.get(key)
    if bundle is None:
        _evict_to(cache_size() - 1)  # before loading: the new weights need the room
        _FREE_BEFORE_LOAD[key] = free_gpu_bytes(device)
        status.say(f"loading the model {spec.model} on {device}")
        if device.type == "cpu":
            # Off CUDA, NABLA is diffusers' processor: eager flex attention, on the CPU's small tiles by design.
            # torch's advice to compile it, once per process, is for GPUs, and filled every CPU worker's log.
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        bundle = load_bundle(spec.model, spec.revision, model_id=spec.model_id, device=device)
        # On CUDA always: eager NABLA without it would build the whole attention matrix (k6vsr_core.model.fast).
        compile_bundle(bundle, compiled=spec.compile)
        _BUNDLES[key] = bundle
        _LOADS.append(_identity(key))
    _BUNDLES.move_to_end(key)
    return bundle


def cache_info() -> CacheInfo:
    """What this process keeps and has loaded (the warm workers' status and tests ask every worker for it)."""
    with _LOCK:
        return CacheInfo(
            pid=os.getpid(),
            gpu=os.environ.get("CUDA_VISIBLE_DEVICES"),
            size=cache_size(),
            loaded=[_identity(key) for key in _BUNDLES],
            loads=list(_LOADS),
        )


def clear() -> None:
    with _LOCK:
        _evict_to(0)
        _FREE_BEFORE_LOAD.clear()
