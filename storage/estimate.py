"""How much disk a run's store takes: an estimate `k6vsr plan` prints before any work.

A window's intermediates (its latent, the denoised tile latents, the decoded tiles and the blended frames) are
deleted once its segments are written, so the store holds a few windows of them at a time whatever the length;
what grows with length is only the encoded video (the segments, then the output).
"""

from __future__ import annotations

from pydantic import BaseModel

from k6vsr_core.plan import ClipPlan
from k6vsr_core.tiling import SPATIAL_FACTOR

# Windows whose intermediates coexist: the one being blended, the one on the GPU and the one being encoded.
WINDOWS_IN_FLIGHT = 3
# H.264 at CRF 18 of upscaled footage; an upper guess (see README, "Run store").
ENCODED_BYTES_PER_PIXEL = 0.05
LATENT_CHANNELS = 64
FLOAT32 = 4


class StoreEstimate(BaseModel):
    window_bytes: int  # the intermediates of one window
    encoded_bytes: int  # the segments of the whole video (the output is as large, once joined)
    peak_bytes: int  # a few windows' intermediates, the segments and the output
    bytes_per_output_minute: int  # the encoded part, which is what grows with length


def store_estimate(plan: ClipPlan) -> StoreEstimate:
    grid = plan.grid
    frames = plan.window_frames
    padded = (grid.padded_size[0] // SPATIAL_FACTOR) * (grid.padded_size[1] // SPATIAL_FACTOR)
    tile = (grid.base[0] // SPATIAL_FACTOR) * (grid.base[1] // SPATIAL_FACTOR)
    latent = LATENT_CHANNELS * plan.latent_frames * padded * FLOAT32
    tile_latents = plan.num_tiles * LATENT_CHANNELS * plan.latent_frames * tile * FLOAT32
    tiles = plan.num_tiles * 3 * frames * grid.base[0] * grid.base[1]
    height, width = plan.delivery_size
    blended = frames * height * width * 3
    window = latent + tile_latents + tiles + blended
    encoded = round(plan.num_frames * height * width * ENCODED_BYTES_PER_PIXEL)
    per_minute = round(60 * plan.fps * height * width * ENCODED_BYTES_PER_PIXEL)
    in_flight = min(WINDOWS_IN_FLIGHT, plan.num_windows)
    return StoreEstimate(
        window_bytes=window,
        encoded_bytes=encoded,
        peak_bytes=in_flight * window + 2 * encoded,
        bytes_per_output_minute=per_minute,
    )
