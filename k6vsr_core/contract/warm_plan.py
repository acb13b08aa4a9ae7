"""What a warm-up runs so that a default run compiles nothing: a plan, and which of its chunks cover its shapes.

Compiled networks (`k6vsr_core.model.fast`) compile once per input shape, on first use: the DiT per denoise chunk shape,
the KVAE decoder per decode call shape. A worker that runs one call of every shape of a plan before its first run
holds those kernels, so that run is as fast as the next. What decides the shapes:

- the DiT sees the *upscaled* LR tiles: (tiles in the chunk, latent frames, trained tile / 16, channels). The LR
  tile is the trained tile divided by the tiling scale and the latent upscaler multiplies it back, so x2, x2.25 and
  x4 give the same shapes; every tile of a grid has the tile's full size (the source is padded up to it);
- the KVAE decoder sees one tile's denoised latent, split in time by the memory budget's chunk (the first latent
  frame alone, then chunks, the last one possibly shorter): the same split for every tile of the same budget;
- the window length: every window of a clip longer than one window computes the full 121 frames.

`warm_plan(traits)` is the plan of a default request (`UpscaleParams()`) on one full 121-frame window of a source
whose grid is one tile of the model's largest trained tile size (the first of the largest: 512x768, landscape, for
the released model). Warming it covers, at every scale, every clip at least one window long whose tile is that
size (every clip wider than about 5:4 for the released model), with the default tile batch (one tile a chunk) and
attention (NABLA). It does not cover, and these compile on their first use: the other trained tile sizes (square
and portrait clips), clips shorter than one window (fewer latent frames), `--attention dense`, a tile batch above
one, and a memory budget other than the one this plan gets on the card (its KVAE chunks differ).
"""

from __future__ import annotations

from k6vsr_core.contract.params import UpscaleParams
from k6vsr_core.contract.plan import ClipPlan, ModelTraits, TileChunk, make_plan
from k6vsr_core.contract.tiling import PRE_UPSCALE, Size, lr_tile_size
from k6vsr_core.contract.windows import WINDOW_FRAMES
from k6vsr_core.media import TARGET_FPS

WARM_FRAMES = WINDOW_FRAMES  # one full window: every window of a clip longer than one has this length


def largest_tile(traits: ModelTraits) -> Size:
    """The model's largest trained tile size; the first listed of equal ones."""
    return max(traits.tile_sizes, key=lambda hw: hw[0] * hw[1])


def one_tile_source(base: Size, params: UpscaleParams) -> Size:
    """A source size whose grid under `params` is exactly one tile of the trained size `base`.

    The LR tile itself at x2 and x4; at x2.25 a size the x1.125 pre-upscale brings to at most the LR tile (even, as
    decoded video is), which the grid pads up to it.
    """
    tile = lr_tile_size(base, params.tiling_scale)
    if not params.pre_upscale:
        return tile
    return int(tile[0] / PRE_UPSCALE) // 2 * 2, int(tile[1] / PRE_UPSCALE) // 2 * 2


def warm_plan(traits: ModelTraits, params: UpscaleParams | None = None) -> ClipPlan:
    """The plan a warm-up runs: `params` (default: the default request) on one full window of a one-tile source of
    the model's largest trained tile size. See the module's docstring for the shapes it covers and those it does not.
    """
    params = params or UpscaleParams()
    base = largest_tile(traits)
    plan = make_plan(one_tile_source(base, params), WARM_FRAMES, float(TARGET_FPS), params, traits)
    if plan.grid.base != base or plan.num_tiles != 1 or plan.window_frames != WARM_FRAMES:
        raise ValueError(
            f"the warm-up plan for tile {base[1]}x{base[0]} (WxH) came out as {plan.num_tiles} tiles of "
            f"{plan.grid.base[1]}x{plan.grid.base[0]} over {plan.window_frames} frames; the model's tile sizes "
            f"{traits.tile_sizes} give the largest another aspect's tile"
        )
    return plan


def warm_chunks(plan: ClipPlan) -> tuple[TileChunk, ...]:
    """The first chunk of each size in `plan`, largest first: one denoise call per DiT shape (a plan whose tile batch
    does not divide its tile count ends with a shorter chunk, another shape)."""
    first: dict[int, TileChunk] = {}
    for chunk in plan.chunks:
        first.setdefault(len(chunk.tiles), chunk)
    return tuple(sorted(first.values(), key=lambda chunk: -len(chunk.tiles)))
