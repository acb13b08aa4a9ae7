"""A stand-in for the three networks, for measuring the orchestration around them: NOT a model.

The benchmarks inject it through the product's networks hook (`k6vsr_core.model.networks`):

    K6VSR_NETWORKS=bench.fake_model:networks K6VSR_FAKE_MODEL_MS=N

and every KVAE encode, DiT chunk and KVAE decode a stage task would run then sleeps N milliseconds instead and returns
zeros of the shape and dtype the real call returns; the calls of one process take turns, as on one GPU. Everything
else is the real pipeline: the flows, the tasks, the run store, the blend, the segments and the mux. It exists so
that the cost of the orchestration (Prefect's API, the scheduler, the store's records) can be measured on a CPU
where the networks would otherwise dominate (`bench/archive_scale.py`). Processes a command starts inherit both
variables, so they all inject it.

Its `identity` (`+fake-model-Nms`) goes into the run key, so a stand-in's run never shares stored tiles or outputs
with a run of the real model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from k6vsr_core.contract.plan import TEMPORAL_FACTOR
from k6vsr_core.contract.tiling import SPATIAL_FACTOR
from k6vsr_core.errors import ParameterError

if TYPE_CHECKING:
    import torch

    from k6vsr_core.contract.plan import ClipPlan, TileChunk
    from k6vsr_core.model.bundle import ModelBundle

SPEC = "bench.fake_model:networks"  # the value of K6VSR_NETWORKS that injects it
FAKE_ENV = "K6VSR_FAKE_MODEL_MS"


class _StandIn(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="K6VSR_", env_ignore_empty=True, extra="ignore")

    fake_model_ms: float | None = Field(None, ge=0, le=10_000)


def environment(ms: float) -> dict[str, str]:
    """The variables that inject the stand-in at `ms` milliseconds a call into a process and those it starts."""
    return {"K6VSR_NETWORKS": SPEC, FAKE_ENV: f"{ms:g}"}


def networks() -> FakeNetworks:
    """The hook's function: the stand-in at the milliseconds `K6VSR_FAKE_MODEL_MS` says (required)."""
    try:
        ms = _StandIn().fake_model_ms
    except ValidationError as err:
        raise ParameterError(f"{FAKE_ENV}: {err.errors()[0]['msg']}") from None
    if ms is None:
        raise ParameterError(f"the network stand-in ({SPEC}) needs {FAKE_ENV}, its milliseconds per call")
    return FakeNetworks(ms)


# One device per process: a GPU runs one call at a time whatever the number of model threads feeding it (they share
# its stream), so two model slots of one process take turns here as they would on the card.
_DEVICE = threading.Lock()


def _pause(ms: float) -> None:
    with _DEVICE:
        time.sleep(ms / 1000.0)


class FakeNetworks:
    """`encode_clip`, `denoise_chunk` and `decode_tile` of `k6vsr_core.model.stages`, with their signatures and output
    shapes, each a fixed pause. The bundle is read for its configuration only (latent channels)."""

    def __init__(self, ms: float) -> None:
        self.ms = ms
        self.identity = f"+fake-model-{ms:g}ms"

    def encode_clip(self, bundle: ModelBundle, video: torch.Tensor) -> torch.Tensor:
        import torch

        _pause(self.ms)
        frames, _, height, width = video.shape
        latent_frames = 1 + (frames - 1) // TEMPORAL_FACTOR
        channels = int(bundle.vae.config.latent_channels)
        return torch.zeros((1, channels, latent_frames, height // SPATIAL_FACTOR, width // SPATIAL_FACTOR))

    def denoise_chunk(
        self,
        bundle: ModelBundle,
        lr_tiles: torch.Tensor,
        chunk: TileChunk,
        plan: ClipPlan,
        on_step: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        import torch

        _pause(self.ms)
        n, channels, frames, height, width = lr_tiles.shape
        scale = plan.params.tiling_scale
        if on_step is not None:
            for step in range(plan.steps):
                on_step(step)
        return torch.zeros((n, channels, frames, height * scale, width * scale))

    def decode_tile(self, bundle: ModelBundle, latent: torch.Tensor, depth: int = 8) -> torch.Tensor:
        import torch

        _pause(self.ms)
        _, frames, height, width = latent.shape
        pixels = 1 + (frames - 1) * TEMPORAL_FACTOR
        dtype = torch.uint16 if depth == 16 else torch.uint8
        return torch.zeros((3, pixels, height * SPATIAL_FACTOR, width * SPATIAL_FACTOR), dtype=dtype)
