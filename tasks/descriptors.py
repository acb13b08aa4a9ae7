"""Small descriptors that tasks take and return: run references, model specs, stage results. Never tensors."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from k6vsr_core.bundle import DEFAULT_MODEL
from k6vsr_core.memory import MemoryMode


class RunRef(BaseModel):
    model_config = ConfigDict(frozen=True)

    store_root: str
    run_key: str


class ModelSpec(BaseModel):
    """Which model a worker loads, and how it runs it: none of these change a computed value, so none enter run keys.

    `device` "auto" means the worker's first GPU if it has one, else the CPU. `memory` is the GPU memory budget
    (`k6vsr_core.memory`); "auto" lets each worker choose from the free memory of its own GPU.
    """

    model_config = ConfigDict(frozen=True)

    model: str = DEFAULT_MODEL
    revision: str | None = None
    model_id: str | None = None
    device: str = "auto"
    compile: bool = False
    memory: MemoryMode = "auto"


class StageResult(BaseModel):
    stage: str
    item: str = "all"
    computed: bool
    seconds: float = 0.0
    dit_calls: int = 0
    tiles: tuple[int, ...] = ()
