"""Small descriptors that tasks take and return: run references, model specs, stage results. Never tensors."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from k6vsr_core.bundle import DEFAULT_MODEL


class RunRef(BaseModel):
    model_config = ConfigDict(frozen=True)

    store_root: str
    run_key: str


class ModelSpec(BaseModel):
    """Which model a worker loads. `device` "auto" means the worker's first GPU if it has one, else the CPU."""

    model_config = ConfigDict(frozen=True)

    model: str = DEFAULT_MODEL
    revision: str | None = None
    model_id: str | None = None
    device: str = "auto"
    compile: bool = False


class StageResult(BaseModel):
    stage: str
    item: str = "all"
    computed: bool
    seconds: float = 0.0
    dit_calls: int = 0
    tiles: tuple[int, ...] = ()
