"""Warm a compiled bundle: one call of each compiled shape of a plan, through the functions a run calls.

`warm_up(bundle, plan)` denoises one chunk of zero LR tiles per chunk size
(`k6vsr_core.contract.warm_plan.warm_chunks`) and
decodes one zero tile latent of the plan's tile shape, with `stages.denoise_chunk` and `stages.decode_tile`: the
same attention switch, scheduler steps, compile watch and KVAE chunking (from the bundle's memory budget) as a run,
so a run of the plan afterwards meets only kernels compiled already. The results are discarded. The encoder is not
compiled (`k6vsr_core.model.fast`), so it is not warmed.

The bundle must be placed under the budget a run of the plan gets (`tasks.model_cache.get_bundle(spec, plan)`):
the decode's chunks, and with them its shapes, come from that budget. And it runs under the compute profile a run
planned in this environment gets (`k6vsr_core.device.compute.default_profile`): compiled graphs are guarded on torch's
thread count too, so a warm-up under another count would leave every graph to compile again.
"""

from __future__ import annotations

import time

import torch
from pydantic import BaseModel

from k6vsr_core.contract.plan import ClipPlan
from k6vsr_core.contract.warm_plan import warm_chunks
from k6vsr_core.device.compute import ComputeProfile, apply_profile, default_profile
from k6vsr_core.model import stages
from k6vsr_core.model.bundle import ModelBundle


class WarmUp(BaseModel):
    """What a warm-up ran: one model call per compiled shape."""

    shapes: int  # DiT chunk shapes plus the tile decode
    seconds: float


def zero_lr_tiles(bundle: ModelBundle, plan: ClipPlan, tiles: int) -> torch.Tensor:
    """Zeros of the shape `stages.cut_tiles` gives for `tiles` tiles of a window: (n, C, t, th, tw) fp32."""
    channels = int(bundle.vae.config.latent_channels)
    return torch.zeros((tiles, channels, plan.latent_frames, *plan.grid.latent_tile), dtype=torch.float32)


def warm_up(bundle: ModelBundle, plan: ClipPlan, compute: ComputeProfile | None = None) -> WarmUp:
    """Run every compiled shape of `plan` once on `bundle`, computing as `compute` (default) says (see the module's
    docstring)."""
    started = time.perf_counter()
    apply_profile(compute or default_profile())
    calls = 0
    tile_latent = None
    for chunk in warm_chunks(plan):
        denoised = stages.denoise_chunk(bundle, zero_lr_tiles(bundle, plan, len(chunk.tiles)), chunk, plan)
        calls += 1
        if tile_latent is None:
            # A tile's denoised latent as the decode gets it; its values do not change which kernels run.
            tile_latent = torch.zeros_like(denoised[0])
    if tile_latent is not None:
        stages.decode_tile(bundle, tile_latent)
        calls += 1
    return WarmUp(shapes=calls, seconds=round(time.perf_counter() - started, 3))
