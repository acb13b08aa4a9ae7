"""The warm workers' preload (`dask worker --preload tasks.worker_preload`): load the model at start when asked.

`flows.warm_workers` sets `K6VSR_WARM_MODEL` (a ModelSpec as JSON) when `k6vsr workers start --model` names one;
each worker then loads it in the background as it starts, so the first tile finds it loaded (a tile that comes
sooner waits for the same load: the model cache holds its lock while loading). Without it, a worker loads each
model on the first tile that needs it.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from service.runs import ModelSpec

MODEL_ENV = "K6VSR_WARM_MODEL"  # a ModelSpec as JSON, set by `flows.warm_workers` for the workers it starts
log = logging.getLogger("k6vsr.workers")


def _load(spec: ModelSpec) -> None:
    from tasks.model_cache import get_bundle

    try:
        get_bundle(spec)
        log.info("warm worker %d: loaded %s", os.getpid(), spec.model)
    except Exception as err:  # noqa: BLE001 - the first tile loads it again and reports the error to its run
        log.warning("warm worker %d: could not load %s: %s", os.getpid(), spec.model, err)


def dask_setup(worker: Any) -> None:
    text = os.environ.get(MODEL_ENV)
    if text:
        threading.Thread(target=_load, args=(ModelSpec.model_validate_json(text),), daemon=True).start()
