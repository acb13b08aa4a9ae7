"""A stand-in for the three networks, for measuring the orchestration around them: NOT a model.

With `K6VSR_FAKE_MODEL_MS=N` (and `K6VSR_BENCH_ONLY=1`, which says the caller knows its outputs are meaningless),
every KVAE encode, DiT chunk and KVAE decode a stage task would run sleeps N milliseconds instead and returns
zeros of the shape and dtype the real call returns; the calls of one process take turns, as on one GPU. Everything
else is the real pipeline: the flows, the tasks, the run store, the blend, the segments and the mux. It exists so
that the cost of the orchestration (Prefect's API, the scheduler, the store's records) can be measured on a CPU
where the networks would otherwise dominate (`bench/archive_scale.py`).

The run key includes the stand-in (`identity_suffix`), so a fake run never shares stored tiles or outputs with a
run of the real model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from k6vsr_core import settings
from k6vsr_core.errors import ParameterError
from k6vsr_core.plan import TEMPORAL_FACTOR
from k6vsr_core.tiling import SPATIAL_FACTOR

if TYPE_CHECKING:
    import torch

    from k6vsr_core.bundle import ModelBundle
    from k6vsr_core.plan import ClipPlan, TileChunk

FAKE_ENV = settings.env_name("fake_model_ms")
MARKER_ENV = settings.env_name("bench_only")


def fake_ms() -> float | None:
    """The stand-in's milliseconds per call when it is selected, else None; refuses a selection without the
    bench marker or with a value that is not a number of milliseconds."""
    bench = settings.read(settings.Bench)
    if bench.fake_model_ms is None:
        return None
    if not bench.bench_only:
        raise ParameterError(
            f"{FAKE_ENV} replaces the model with a stand-in that returns zeros, for measuring the orchestration "
            f"only; set {MARKER_ENV}=1 as well to say so, or unset {FAKE_ENV}"
        )
    return bench.fake_model_ms


def identity_suffix() -> str:
    """What the model's identity gains while the stand-in is selected: a run key of its own."""
    ms = fake_ms()
    return "" if ms is None else f"+fake-model-{ms:g}ms"


# One device per process: a GPU runs one call at a time whatever the number of model threads feeding it (they share
# its stream), so two model slots of one process take turns here as they would on the card.
_DEVICE = threading.Lock()


def _pause(ms: float) -> None:
    with _DEVICE:
        time.sleep(ms / 1000.0)


class FakeNetworks:
    """`encode_clip`, `denoise_chunk` and `decode_tile` of `k6vsr_core.stages`, with their signatures and output
    shapes, each a fixed pause. The bundle is read for its configuration only (latent channels)."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

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

    def decode_tile(self, bundle: ModelBundle, latent: torch.Tensor) -> torch.Tensor:
        import torch

        _pause(self.ms)
        _, frames, height, width = latent.shape
        pixels = 1 + (frames - 1) * TEMPORAL_FACTOR
        return torch.zeros((3, pixels, height * SPATIAL_FACTOR, width * SPATIAL_FACTOR), dtype=torch.uint8)
