"""Tests for k6vsr_core.model.stages against diffusers' own model calls, written out in the tests (bitwise where the
arithmetic is the same), on the tiny bundles and fixed random inputs."""

from __future__ import annotations

import json
import math
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from k6vsr_core.contract.params import parse_params
from k6vsr_core.contract.plan import ClipPlan, make_plan
from k6vsr_core.model import stages
from k6vsr_core.model.attention import DenseSdpaProcessor, set_attention
from k6vsr_core.model.bundle import ModelBundle, model_traits
from k6vsr_core.model.pixels import crop_output, hann_window_2d

CPU = torch.device("cpu")


def _plan(bundle: ModelBundle, size: tuple[int, int] = (64, 96), frames: int = 1, **params: object) -> ClipPlan:
    return make_plan(size, frames, 24, parse_params(**{"scale": 2, **params}), model_traits(bundle.info))


def _random(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _set_processors(transformer: torch.nn.Module, processor_cls: type) -> None:
    from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRAttention

    for module in transformer.modules():
        if isinstance(module, Kandinsky6SRAttention):
            module.set_processor(processor_cls())


def _processor_types(transformer: torch.nn.Module) -> set[type]:
    from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRAttention

    return {type(module.processor) for module in transformer.modules() if isinstance(module, Kandinsky6SRAttention)}


def _manual_piflow(bundle: ModelBundle, bundle_path: Path, lr_tiles: torch.Tensor, seed: int) -> torch.Tensor:
    """The contract's denoise of one chunk written with diffusers calls only."""
    from diffusers import PiflowScheduler

    with torch.no_grad():
        upscaled = bundle.latent_upscaler(lr_tiles, scale=2, return_dict=False)[0]
        lq = upscaled.permute(0, 2, 3, 4, 1)  # (n, t, H, W, C)
        n, t, h, w, c = lq.shape
        generator = torch.Generator(device="cpu").manual_seed(seed)
        noise = torch.randn((n * t, h, w, c), generator=generator).reshape(n, t, h, w, c)
        latents = math.sqrt(1 - 0.7**2) * lq + 0.7 * noise
        config = json.loads((bundle_path / "scheduler" / "scheduler_config.json").read_text())
        scheduler = PiflowScheduler.from_config({k: v for k, v in config.items() if k != "nfe"})
        assert scheduler.config.shift == 3.5
        scheduler.set_timesteps(2)
        for timestep in scheduler.timesteps:
            anchor = torch.zeros_like(latents)
            anchor_mask = torch.zeros((*latents.shape[:-1], 1))
            prediction = bundle.transformer(
                hidden_states=torch.cat([latents, anchor, anchor_mask], dim=-1),
                timestep=timestep.expand(n),
                return_dict=False,
            )[0]
            latents = scheduler.step(prediction, timestep, latents, return_dict=False)[0]
    return latents.permute(0, 4, 1, 2, 3)


# --------------------------------------------------------------------------------------------------- source


def test_frames_to_tensor_and_back() -> None:
    frames = np.random.default_rng(0).integers(0, 256, (2, 4, 6, 3), dtype=np.uint8)
    video = stages.frames_to_tensor(frames)
    assert video.shape == (2, 3, 4, 6)
    assert int(video[1, 2, 3, 5]) == int(frames[1, 3, 5, 2])
    back = stages.tensor_to_frames(video.permute(1, 0, 2, 3))
    assert np.array_equal(back, frames)
    with pytest.raises(ValueError):
        stages.frames_to_tensor(frames.astype(np.float32))


def test_prepare_source_pads_bottom_right(tiny_bundle: ModelBundle) -> None:
    plan = _plan(tiny_bundle, (40, 40))
    assert plan.grid.padded_size == (64, 64)
    frames = np.random.default_rng(1).integers(0, 256, (1, 40, 40, 3), dtype=np.uint8)
    video = stages.prepare_window(frames, plan, plan.windows[0])
    assert video.shape == (1, 3, 64, 64) and video.dtype == torch.uint8
    source = torch.from_numpy(frames).permute(0, 3, 1, 2)
    assert torch.equal(video[..., :40, :40], source)
    # Reflect padding: row 40 mirrors row 38, column 40 mirrors column 38.
    assert torch.equal(video[..., 40, :40], source[..., 38, :])
    assert torch.equal(video[..., :40, 40], source[..., :, 38])
    with pytest.raises(ValueError):
        stages.prepare_window(frames[:, :32], plan, plan.windows[0])


def test_prepare_window_pads_time_by_repeating_the_last_frame(tiny_bundle: ModelBundle) -> None:
    plan = _plan(tiny_bundle, (64, 64), frames=5)
    assert plan.windows[0].padded == 9 and plan.window_frames == 9
    frames = np.random.default_rng(2).integers(0, 256, (5, 64, 64, 3), dtype=np.uint8)
    video = stages.prepare_window(frames, plan, plan.windows[0])
    assert video.shape == (9, 3, 64, 64)
    assert all(torch.equal(video[t], video[4]) for t in range(5, 9))
    assert torch.equal(video[:5], torch.from_numpy(frames).permute(0, 3, 1, 2))


def test_prepare_source_pre_upscales_for_x225(tiny_bundle: ModelBundle) -> None:
    plan = _plan(tiny_bundle, (64, 96), scale=2.25)
    assert plan.grid.source_size == (64, 112)
    assert plan.grid.padded_size == (64, 128)
    frames = np.random.default_rng(2).integers(0, 256, (1, 64, 96, 3), dtype=np.uint8)
    video = stages.prepare_window(frames, plan, plan.windows[0])
    assert video.shape == (1, 3, 64, 128)
    source = torch.from_numpy(frames).permute(0, 3, 1, 2).float()
    resized = F.interpolate(source, size=(64, 112), mode="bilinear", align_corners=False)
    expected = resized.round().clamp(0, 255).to(torch.uint8)
    assert torch.equal(video[..., :112], expected)


# --------------------------------------------------------------------------------------------------- encode


def test_encode_clip_equals_diffusers_vae(tiny_bundle: ModelBundle) -> None:
    video = torch.randint(0, 256, (9, 3, 64, 96), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    latent = stages.encode_clip(tiny_bundle, video)
    assert latent.shape == (1, 64, 3, 4, 6) and latent.dtype == torch.float32
    vae = tiny_bundle.vae
    with torch.no_grad():
        pixels = video.permute(1, 0, 2, 3).unsqueeze(0).float() / 128 - 1
        expected = vae.encode(pixels).latent_dist.mode() * vae.config.scaling_factor
    assert vae.config.scaling_factor == pytest.approx(0.910344004631042)
    assert torch.equal(latent, expected)


def test_cut_tiles_follow_the_latent_grid(tiny_bundle: ModelBundle) -> None:
    plan = _plan(tiny_bundle)
    assert plan.grid.positions == [(0, 0), (0, 32)]
    latent = _random((1, 64, 1, 4, 6), 4)
    tiles = stages.cut_tiles(latent, plan, (1, 0))
    assert tiles.shape == (2, 64, 1, 4, 4)
    assert torch.equal(tiles[0], latent[0, :, :, 0:4, 2:6])
    assert torch.equal(tiles[1], latent[0, :, :, 0:4, 0:4])


# --------------------------------------------------------------------------------------------------- denoise


def test_denoise_chunk_equals_diffusers_loop_nabla(tiny_bundle: ModelBundle, tiny_bundle_path: Path) -> None:
    from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRAttnProcessor

    plan = _plan(tiny_bundle)
    chunk = plan.chunks[1]
    assert chunk.tiles == (1,) and chunk.seed == 43
    lr_tiles = _random((1, 64, 1, 4, 4), 5)
    steps: list[int] = []
    result = stages.denoise_chunk(tiny_bundle, lr_tiles, chunk, plan, steps.append)
    assert steps == [0, 1]
    assert result.shape == (1, 64, 1, 8, 8) and result.dtype == torch.float32
    assert DenseSdpaProcessor not in _processor_types(tiny_bundle.transformer)  # NABLA's
    _set_processors(tiny_bundle.transformer, Kandinsky6SRAttnProcessor)
    expected = _manual_piflow(tiny_bundle, tiny_bundle_path, lr_tiles, seed=43)
    assert torch.equal(result, expected)
    # The seed matters: the same loop with the first chunk's seed is another result.
    assert not torch.equal(result, _manual_piflow(tiny_bundle, tiny_bundle_path, lr_tiles, seed=42))


def test_denoise_chunk_equals_diffusers_loop_dense(tiny_bundle: ModelBundle, tiny_bundle_path: Path) -> None:
    plan = _plan(tiny_bundle, attention="dense")
    lr_tiles = _random((1, 64, 1, 4, 4), 6)
    try:
        result = stages.denoise_chunk(tiny_bundle, lr_tiles, plan.chunks[0], plan)
        assert _processor_types(tiny_bundle.transformer) == {DenseSdpaProcessor}
        _set_processors(tiny_bundle.transformer, DenseSdpaProcessor)
        expected = _manual_piflow(tiny_bundle, tiny_bundle_path, lr_tiles, seed=42)
    finally:
        set_attention(tiny_bundle.transformer, "nabla")
    assert torch.equal(result, expected)


def test_dense_processor_matches_nabla_when_nabla_keeps_every_block(tiny_bundle: ModelBundle) -> None:
    """An 8x8-latent, 1-frame tile is a single NABLA block, so NABLA attends to everything: dense must agree."""
    from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRAttnProcessor

    dit = tiny_bundle.transformer
    hidden = _random((1, 1, 8, 8, 129), 7)
    timestep = torch.tensor([700.0])
    try:
        with torch.no_grad():
            _set_processors(dit, Kandinsky6SRAttnProcessor)
            nabla = dit(hidden_states=hidden, timestep=timestep, return_dict=False)[0]
            _set_processors(dit, DenseSdpaProcessor)
            dense = dit(hidden_states=hidden, timestep=timestep, return_dict=False)[0]
    finally:
        set_attention(dit, "nabla")
    assert nabla.shape == (1, 1, 8, 8, 640)
    torch.testing.assert_close(dense, nabla, rtol=1e-4, atol=1e-5)


def test_denoise_chunk_of_two_tiles_batches_the_noise(tiny_bundle: ModelBundle, tiny_bundle_path: Path) -> None:
    plan = _plan(tiny_bundle, tiles_batch_size=2)
    chunk = plan.chunks[0]
    assert chunk.tiles == (0, 1) and chunk.seed == 42
    lr_tiles = _random((2, 64, 1, 4, 4), 8)
    result = stages.denoise_chunk(tiny_bundle, lr_tiles, chunk, plan)
    expected = _manual_piflow(tiny_bundle, tiny_bundle_path, lr_tiles, seed=42)
    assert torch.equal(result, expected)


@pytest.mark.parametrize(
    ("batch", "tile", "seed", "position", "chunk_size"),
    [(4, 6, 46, 2, 4), (4, 8, 50, 0, 1), (2, 3, 44, 1, 2), (1, 5, 47, 0, 1)],
)
def test_chunk_noise_seed_rule(batch: int, tile: int, seed: int, position: int, chunk_size: int) -> None:
    """Tile j's noise with batch B is slice (j mod B) of the draw seeded seed + B*floor(j/B)."""
    plan = make_plan((512, 768), 9, 24, parse_params(scale=2, tiles_batch_size=batch))
    chunk = plan.chunk_of(tile)
    assert chunk.seed == seed
    assert len(chunk.tiles) == chunk_size
    assert chunk.tiles.index(tile) == position
    t, h, w, c = 3, 2, 2, 5
    noise = stages.chunk_noise((chunk_size, t, h, w, c), chunk.seed, CPU, torch.float32)
    assert noise.shape == (chunk_size, t, h, w, c)
    draw = torch.randn((chunk_size * t, h, w, c), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(noise[position], draw[position * t : (position + 1) * t])


def test_tile_noise_depends_on_batch_size() -> None:
    t, h, w, c = 3, 2, 2, 5
    alone = stages.chunk_noise((1, t, h, w, c), 42 + 6, CPU, torch.float32)[0]
    in_chunk = stages.chunk_noise((4, t, h, w, c), 42 + 4, CPU, torch.float32)[2]
    assert not torch.equal(alone, in_chunk)


# --------------------------------------------------------------------------------------------------- schedules


def test_flow_euler_sigmas_are_the_official_ones(flow_bundle: ModelBundle) -> None:
    plan = _plan(flow_bundle)
    assert plan.steps == 4
    scheduler = flow_bundle.new_scheduler()
    timesteps = stages._timesteps(scheduler, plan, CPU)
    # linspace(1, 0, 5)[:-1] = (1, .75, .5, .25), shifted 5t/(1+4t), then 0 appended.
    expected = torch.tensor([1.0, 0.9375, 2.5 / 3, 0.625, 0.0], dtype=torch.float64)
    torch.testing.assert_close(scheduler.sigmas.double(), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(timesteps.double(), expected[:-1] * 1000, rtol=0, atol=1e-3)


def test_flow_euler_sigmas_two_steps(flow_bundle: ModelBundle) -> None:
    plan = _plan(flow_bundle, num_inference_steps=2)
    scheduler = flow_bundle.new_scheduler()
    stages._timesteps(scheduler, plan, CPU)
    # (1, .5) -> (1, 2.5/3), then 0.
    torch.testing.assert_close(
        scheduler.sigmas.double(), torch.tensor([1.0, 2.5 / 3, 0.0], dtype=torch.float64), rtol=0, atol=1e-6
    )


def test_piflow_timesteps(tiny_bundle: ModelBundle) -> None:
    plan = _plan(tiny_bundle)
    timesteps = stages._timesteps(tiny_bundle.new_scheduler(), plan, CPU)
    torch.testing.assert_close(
        timesteps.double(), torch.tensor([1000.0, 7000 / 11], dtype=torch.float64), rtol=0, atol=1e-3
    )


def test_flow_euler_denoise_is_the_official_euler_loop(flow_bundle: ModelBundle) -> None:
    """OFF: x += (sigma_{i+1} - sigma_i) * v with model time 1000 * sigma_i, on sigmas written out by hand."""
    plan = _plan(flow_bundle)
    lr_tiles = _random((1, 64, 1, 4, 4), 9)
    calls: list[int] = []
    result = stages.denoise_chunk(flow_bundle, lr_tiles, plan.chunks[0], plan, calls.append)
    assert calls == [0, 1, 2, 3]
    sigmas = [1.0, 0.9375, 2.5 / 3, 0.625, 0.0]
    with torch.no_grad():
        lq = flow_bundle.latent_upscaler(lr_tiles, scale=2, return_dict=False)[0].permute(0, 2, 3, 4, 1)
        noise = torch.randn(lq.shape, generator=torch.Generator().manual_seed(42))
        x = math.sqrt(0.51) * lq + 0.7 * noise
        zeros = torch.zeros((*x.shape[:-1], 65))
        for sigma, sigma_next in pairwise(sigmas):
            v = flow_bundle.transformer(
                hidden_states=torch.cat([x, zeros], dim=-1), timestep=torch.tensor([1000 * sigma]), return_dict=False
            )[0]
            assert v.shape[-1] == 64
            x = x + (sigma_next - sigma) * v
    torch.testing.assert_close(result, x.permute(0, 4, 1, 2, 3), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------- decode, blend


def test_decode_tile_equals_diffusers_vae(tiny_bundle: ModelBundle) -> None:
    latent = _random((64, 1, 8, 8), 10)
    tile = stages.decode_tile(tiny_bundle, latent)
    assert tile.shape == (3, 1, 128, 128) and tile.dtype == torch.uint8
    vae = tiny_bundle.vae
    with torch.no_grad():
        decoded = vae.decode(latent.unsqueeze(0) / vae.config.scaling_factor).sample[0]
    expected = (((decoded + 1) * 128 / 255).clamp(0, 1) * 255).to(torch.uint8)  # truncation
    assert torch.equal(tile, expected)
    assert int(tile.max()) > int(tile.min())


def test_blend_and_deliver(tiny_bundle: ModelBundle) -> None:
    plan = _plan(tiny_bundle, target_resolution="96x64")
    assert plan.sr_size == (128, 192) and plan.delivery_size == (64, 96)
    tiles = [
        (1, torch.full((3, 1, 128, 128), 128, dtype=torch.uint8)),
        (0, torch.full((3, 1, 128, 128), 128, dtype=torch.uint8)),
    ]
    video = stages.blend(plan, tiles, plan.windows[0])
    assert video.shape == (3, 1, 128, 192)
    assert bool((video == 128).all())  # corners included
    delivered = stages.deliver(video, plan)
    assert delivered.shape == (3, 1, 64, 96) and delivered.dtype == torch.uint8
    same = _plan(tiny_bundle)
    assert stages.deliver(video, same) is video


# Real plans with the released tile sizes: x2, x2.25 and x4; landscape, portrait, square and odd sizes; one to nine
# tiles. The canvases stay under 2 megapixels and the tile sets are one frame.
REAL_PLANS = [
    ((512, 768), 2),
    ((360, 640), 2),
    ((600, 400), 2),
    ((301, 223), 2),
    ((250, 250), 2),
    ((320, 480), 2.25),
    ((237, 411), 2.25),
    ((256, 384), 4),
    ((131, 197), 4),
]


def _real_plan(size: tuple[int, int], scale: float) -> ClipPlan:
    return make_plan(size, 1, 24, parse_params(scale=scale))


def _random_tiles(plan: ClipPlan, seed: int) -> list[tuple[int, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shape = (3, plan.num_frames, *plan.grid.base)
    return [(i, torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)) for i in range(plan.num_tiles)]


def _official_blend(plan: ClipPlan, tiles: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The official arithmetic, trunc(clamp(acc / max(wsum, 1e-6))), and the summed weights, both cropped."""
    grid = plan.grid
    window = hann_window_2d(*grid.base)
    acc = torch.zeros((3, plan.num_frames, *grid.canvas_size), dtype=torch.float32)
    weight = torch.zeros(grid.canvas_size, dtype=torch.float32)
    for index, tile in tiles:
        top, left = grid.output_origin(index)
        acc[:, :, top : top + grid.base[0], left : left + grid.base[1]] += tile.float() * window
        weight[top : top + grid.base[0], left : left + grid.base[1]] += window
    blended = (acc / weight.clamp(min=1e-6)).clamp(0, 255).to(torch.uint8)
    return crop_output(blended, grid), crop_output(weight, grid)


def _covering_range(plan: ClipPlan, tiles: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output pixel, the darkest and brightest value among the tiles covering it."""
    grid = plan.grid
    low = torch.full((3, plan.num_frames, *grid.canvas_size), 255, dtype=torch.uint8)
    high = torch.zeros_like(low)
    for index, tile in tiles:
        top, left = grid.output_origin(index)
        region = (..., slice(top, top + grid.base[0]), slice(left, left + grid.base[1]))
        low[region] = torch.minimum(low[region], tile)
        high[region] = torch.maximum(high[region], tile)
    return crop_output(low, grid), crop_output(high, grid)


@pytest.mark.parametrize(("size", "scale"), REAL_PLANS)
def test_blend_of_constant_tiles_is_that_constant_at_the_corners_too(size: tuple[int, int], scale: float) -> None:
    plan = _real_plan(size, scale)
    for value in (1, 64, 128):
        # Scaling by a power of two is exact in float32, so acc = value * wsum exactly and the mean is exact.
        video = stages.blend(
            plan,
            [(i, torch.full((3, 1, *plan.grid.base), value, dtype=torch.uint8)) for i in range(plan.num_tiles)],
            plan.windows[0],
        )
        assert video.shape == (3, 1, *plan.sr_size)
        assert bool((video == value).all()), value
    for value in (77, 200, 255):
        # Other values keep the float round trip and truncation of the official blend: at most 1 LSB darker.
        video = stages.blend(
            plan,
            [(i, torch.full((3, 1, *plan.grid.base), value, dtype=torch.uint8)) for i in range(plan.num_tiles)],
            plan.windows[0],
        )
        assert int(video.min()) >= value - 1 and int(video.max()) <= value, value


@pytest.mark.parametrize(("size", "scale"), REAL_PLANS)
def test_blend_stays_within_the_tiles_covering_each_pixel(size: tuple[int, int], scale: float) -> None:
    plan = _real_plan(size, scale)
    tiles = _random_tiles(plan, seed=size[0] + size[1])
    video = stages.blend(plan, tiles, plan.windows[0])
    low, high = _covering_range(plan, tiles)
    # A weighted mean lies between the values it averages, up to the 1-LSB truncation of the float result.
    assert bool((video.int() >= low.int() - 1).all())
    assert bool((video <= high).all())


@pytest.mark.parametrize(("size", "scale"), REAL_PLANS)
def test_blend_changes_only_pixels_below_the_official_floor(size: tuple[int, int], scale: float) -> None:
    plan = _real_plan(size, scale)
    tiles = _random_tiles(plan, seed=size[0] * size[1])
    video = stages.blend(plan, tiles, plan.windows[0])
    official, weight = _official_blend(plan, tiles)
    floored = weight < 1e-6
    assert bool(floored[0, 0])  # the top-left corner is always kept and always below the floor
    assert torch.equal(video[..., ~floored], official[..., ~floored])
    # Below the floor the official blend divides by more than the weight: it is darker, never brighter.
    assert bool((official[..., floored] <= video[..., floored]).all())
    assert bool((official[..., floored] < video[..., floored]).any())
