"""One loaded model per worker process, kept for the life of the process.

Tasks run in the flow's process (thread pool) or in Dask worker processes; either way the model is loaded once per
process and reused by every tile it runs. It lives in an importable module because functions defined in a flow
script are shipped by value to Dask workers, and a cache there would be rebuilt for every task.
"""

from __future__ import annotations

import threading

import torch

from k6vsr_core.bundle import ModelBundle, load_bundle
from service.runs import ModelSpec

_LOCK = threading.Lock()
_BUNDLES: dict[ModelSpec, ModelBundle] = {}


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_bundle(spec: ModelSpec) -> ModelBundle:
    with _LOCK:
        bundle = _BUNDLES.get(spec)
        if bundle is None:
            bundle = load_bundle(
                spec.model, spec.revision, model_id=spec.model_id, device=resolve_device(spec.device)
            )
            if spec.compile:
                from k6vsr_core.fast import compile_bundle

                compile_bundle(bundle)
            _BUNDLES[spec] = bundle
        return bundle


def loaded_count() -> int:
    return len(_BUNDLES)


def clear() -> None:
    with _LOCK:
        _BUNDLES.clear()
