"""The plan of one clip: everything a run will do, decided before any model work.

A plan is pure data computed from the source's size, frame count and rate, the request and the model's trained
tile sizes and sampler. The in-memory runner, the orchestrated flow, `k6vsr plan` and the run manifest all use the
same plan, which is what makes their outputs comparable byte for byte.
"""

from __future__ import annotations

import warnings

from pydantic import BaseModel, ConfigDict

from k6vsr_core.params import UpscaleParams
from k6vsr_core.tiling import (
    RESOLUTIONS,
    Size,
    TileGrid,
    pre_upscale_size,
    target_size,
    tile_chunks,
    tile_grid,
)

TEMPORAL_FACTOR = 4


class ModelTraits(BaseModel):
    """What the plan needs to know of the model, without loading it."""

    model_config = ConfigDict(frozen=True)

    tile_sizes: tuple[tuple[int, int], ...] = RESOLUTIONS
    scheduler: str = "PiflowScheduler"
    trained_steps: int = 2


class TileChunk(BaseModel):
    model_config = ConfigDict(frozen=True)

    index: int
    tiles: tuple[int, ...]
    seed: int  # request seed + the chunk's first tile index (official seeding)


class ClipPlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    source_size: Size  # (H, W) of the decoded source frames
    num_frames: int  # kept frames, 1 + 8k
    fps: int
    latent_frames: int
    params: UpscaleParams
    steps: int
    grid: TileGrid
    chunks: tuple[TileChunk, ...]
    sr_size: Size  # (H, W) after blending and cropping
    delivery_size: Size  # (H, W) of the written video

    @property
    def num_tiles(self) -> int:
        return self.grid.num_tiles

    def chunk_of(self, tile: int) -> TileChunk:
        return next(chunk for chunk in self.chunks if tile in chunk.tiles)


def resolve_steps(params: UpscaleParams, traits: ModelTraits) -> int:
    """DiT evaluations per tile: the trained count for PiFlow (warns if asked otherwise), else as asked (4)."""
    if traits.scheduler == "PiflowScheduler":
        if params.num_inference_steps not in (None, traits.trained_steps):
            warnings.warn(
                f"num_inference_steps={params.num_inference_steps} is ignored: this distilled checkpoint runs the "
                f"{traits.trained_steps} PiFlow evaluations it was trained for",
                stacklevel=2,
            )
        return traits.trained_steps
    return params.num_inference_steps or 4


def make_plan(
    source_size: Size,
    num_frames: int,
    fps: int,
    params: UpscaleParams,
    traits: ModelTraits | None = None,
) -> ClipPlan:
    """Plan a clip of `num_frames` kept frames (already 1 + 8k) of `source_size` at `fps`."""
    traits = traits or ModelTraits()
    if num_frames < 1 or (num_frames - 1) % 8:
        raise ValueError(f"a clip needs 1 + 8k frames, got {num_frames}")
    height, width = source_size
    if params.pre_upscale:
        height, width = pre_upscale_size(height, width)
    grid = tile_grid(height, width, params.tiling_scale, params.min_overlap, traits.tile_sizes)
    chunks = tuple(
        TileChunk(index=i, tiles=tuple(chunk), seed=params.seed + chunk.start)
        for i, chunk in enumerate(tile_chunks(grid.num_tiles, params.tiles_batch_size))
    )
    if params.tiles_batch_size > 1 and grid.num_tiles > 1:
        warnings.warn(
            f"tiles_batch_size={params.tiles_batch_size} is not lossless: under the official seeding every tile that "
            "is not first in its chunk gets other noise, so the output differs from tiles_batch_size=1",
            stacklevel=2,
        )
    sr_size = grid.output_size
    delivery = target_size(*sr_size, params.target_resolution, params.target_resize_mode) or sr_size
    return ClipPlan(
        source_size=source_size,
        num_frames=num_frames,
        fps=fps,
        latent_frames=1 + (num_frames - 1) // TEMPORAL_FACTOR,
        params=params,
        steps=resolve_steps(params, traits),
        grid=grid,
        chunks=chunks,
        sr_size=sr_size,
        delivery_size=delivery,
    )
