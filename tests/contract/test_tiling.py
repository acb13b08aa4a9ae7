"""Tests for k6vsr_core.contract.tiling against the contract's rules and worked examples (§A.4, §A.5, §B, §E, §F).

Every expected value below was computed by hand from the contract's formulas and is written literally.
"""

from __future__ import annotations

import math
import warnings
from itertools import pairwise

import pytest
import torch

from k6vsr_core.contract.tiling import (
    RESOLUTIONS,
    TileGrid,
    axis_positions,
    closest_base,
    lr_tile_size,
    padded_size,
    pre_upscale_size,
    target_size,
    tile_chunks,
    tile_grid,
)
from k6vsr_core.model.pixels import TileBlender, crop_output, hann_window_2d, pad_video
from k6vsr_core.model.tiny_bundle import TINY_TILE_SIZES

# --------------------------------------------------------------------------------------------------- grid


def test_worked_example_512x768_x2() -> None:
    grid = tile_grid(512, 768, 2, 0.2)
    assert grid.base == (512, 768)
    assert grid.tile == (256, 384)
    assert grid.tops == (0, 128, 256)
    assert grid.lefts == (0, 192, 384)
    assert grid.num_tiles == 9
    assert grid.padded_size == (512, 768)
    assert grid.padding == (0, 0)
    assert grid.output_size == (1024, 1536)
    assert grid.latent_tile == (16, 24)
    # Row-major order; latent grid = pixel grid / 16 (contract §B, §I: latent tops 0, 8, 16, lefts 0, 12, 24).
    assert grid.positions[:4] == [(0, 0), (0, 192), (0, 384), (128, 0)]
    assert grid.latent_slices(4) == (slice(8, 24), slice(12, 36))
    assert grid.output_origin(8) == (512, 768)


@pytest.mark.parametrize(
    ("height", "width", "scale", "rows", "cols"),
    [(720, 1280, 2, 4, 4), (1080, 1920, 2, 6, 7), (576, 864, 2, 3, 3), (480, 864, 4, 5, 6)],
)
def test_contract_grid_counts(height: int, width: int, scale: int, rows: int, cols: int) -> None:
    grid = tile_grid(height, width, scale, 0.2)
    assert (len(grid.tops), len(grid.lefts)) == (rows, cols)


def test_1080p_grid_positions() -> None:
    # 1080 pads to 1088; span (1088-256)/16 = 52, stride floor(256*0.8/16) = 12 -> 6 tiles at round(i*52/5)*16.
    grid = tile_grid(1080, 1920, 2, 0.2)
    assert grid.padded_size == (1088, 1920)
    assert grid.tops == (0, 160, 336, 496, 672, 832)
    assert grid.lefts == (0, 256, 512, 768, 1024, 1280, 1536)


def test_axis_positions_tile_covers_axis() -> None:
    assert axis_positions(256, 256, 0.2) == (0,)
    assert axis_positions(100, 256, 0.2) == (0,)


def test_axis_positions_unit_1_when_not_on_stride() -> None:
    # length 100 is not a multiple of 16: unit 1, span 36, stride floor(64*0.8) = 51 -> 2 tiles.
    assert axis_positions(100, 64, 0.2) == (0, 36)
    # span 186, stride 51 -> 5 tiles at round(i*46.5): 46.5 -> 46 and 139.5 -> 140 (half to even).
    assert axis_positions(250, 64, 0.2) == (0, 46, 93, 140, 186)


def test_axis_positions_unit_16_on_stride() -> None:
    # span (768-384)/16 = 24, stride floor(384*0.8/16) = 19 -> 3 tiles, 16-px aligned.
    assert axis_positions(768, 384, 0.2) == (0, 192, 384)
    # tile not a multiple of 16 -> unit 1 even though the length is: span 504, stride 200 -> 4 tiles.
    assert axis_positions(768, 264, 0.2) == (0, 168, 336, 504)


@pytest.mark.parametrize(("length", "tile"), [(512, 256), (520, 256), (1000, 300), (1088, 256)])
def test_axis_positions_zero_overlap_still_covers(length: int, tile: int) -> None:
    positions = axis_positions(length, tile, 0.0)
    assert positions[0] == 0
    assert positions[-1] + tile == length
    assert all(b - a <= tile for a, b in pairwise(positions))


def test_axis_positions_zero_overlap_values() -> None:
    assert axis_positions(512, 256, 0.0) == (0, 256)
    # 520 is off the stride: unit 1, span 264, stride 256 -> 3 tiles.
    assert axis_positions(520, 256, 0.0) == (0, 132, 264)


@pytest.mark.parametrize(("length", "tile", "overlap"), [(1088, 256, 0.2), (1920, 384, 0.2), (864, 192, 0.5)])
def test_axis_positions_respect_min_overlap(length: int, tile: int, overlap: float) -> None:
    positions = axis_positions(length, tile, overlap)
    assert all(tile - (b - a) >= overlap * tile for a, b in pairwise(positions))


def test_axis_positions_rejects_non_positive() -> None:
    with pytest.raises(ValueError):
        axis_positions(0, 16, 0.2)
    with pytest.raises(ValueError):
        axis_positions(16, 0, 0.2)


@pytest.mark.parametrize(
    ("height", "width", "base"),
    [
        (100, 100, (512, 512)),  # square
        (100, 200, (512, 768)),  # landscape, ratio 2
        (200, 100, (768, 512)),  # portrait, ratio 0.5
        (720, 1280, (512, 768)),
        (1280, 720, (768, 512)),
        (400, 500, (512, 512)),  # ratio 1.25: tie between 1.0 and 1.5 -> first listed wins
    ],
)
def test_closest_base(height: int, width: int, base: tuple[int, int]) -> None:
    assert closest_base(height, width) == base


def test_closest_base_tie_goes_to_first_listed() -> None:
    assert closest_base(400, 500, ((512, 768), (512, 512))) == (512, 768)
    # Tiny tile sizes: 64x96 has ratio 1.5, exactly between 1 and 2.
    assert closest_base(64, 96, TINY_TILE_SIZES) == (128, 128)


def test_closest_base_rejects_empty_size() -> None:
    with pytest.raises(ValueError):
        closest_base(0, 10)


def test_lr_tile_size() -> None:
    assert lr_tile_size((512, 768), 2) == (256, 384)
    assert lr_tile_size((768, 512), 4) == (192, 128)
    with pytest.raises(ValueError):
        lr_tile_size((520, 768), 2)


def test_pre_upscale_size() -> None:
    assert pre_upscale_size(480, 864) == (544, 976)
    # round(4*1.125/16) = 0 -> floor of 16.
    assert pre_upscale_size(4, 4) == (16, 16)
    assert pre_upscale_size(16, 8) == (16, 16)
    # 64*1.125 = 72 = 4.5*16 -> 4 (half to even); 96*1.125 = 108 = 6.75*16 -> 7.
    assert pre_upscale_size(64, 96) == (64, 112)


@pytest.mark.parametrize(
    ("height", "width", "scale", "expected"),
    [
        # 161x257 -> stride (176, 272), ratio 1.55 -> base 512x768; x2 tile 256x384 is larger on both axes.
        (161, 257, 2, (256, 384)),
        # x4 tile 128x192 fits inside (176, 272): stride padding only.
        (161, 257, 4, (176, 272)),
        # 60x100 -> (64, 112), ratio 1.75 -> 512x768: one tile 256x384 (x2) or 128x192 (x4).
        (60, 100, 2, (256, 384)),
        (60, 100, 4, (128, 192)),
        # 200x100 portrait -> (208, 112) -> 768x512, x2 tile 384x256.
        (200, 100, 2, (384, 256)),
        # Already on the stride and larger than a tile: unchanged.
        (512, 768, 2, (512, 768)),
        (480, 864, 4, (480, 864)),
    ],
)
def test_padded_size(height: int, width: int, scale: int, expected: tuple[int, int]) -> None:
    assert padded_size(height, width, scale) == expected


def test_padded_size_tiny_tiles() -> None:
    # 64x96 (ratio 1.5, tie -> 128x128): x2 tile 64x64 fits; x4 tile 32x32 fits.
    assert padded_size(64, 96, 2, TINY_TILE_SIZES) == (64, 96)
    # 40x40 -> stride (48, 48) -> square tile 64x64 at x2.
    assert padded_size(40, 40, 2, TINY_TILE_SIZES) == (64, 64)


def test_grid_of_padded_source_keeps_source_output() -> None:
    grid = tile_grid(161, 257, 2, 0.2)
    assert grid.source_size == (161, 257)
    assert grid.padded_size == (256, 384)
    assert grid.padding == (95, 127)
    assert grid.canvas_size == (512, 768)
    assert grid.output_size == (322, 514)
    assert grid.num_tiles == 1


def test_tile_chunks() -> None:
    assert tile_chunks(9, 4) == [range(0, 4), range(4, 8), range(8, 9)]
    assert tile_chunks(9, 1) == [range(i, i + 1) for i in range(9)]
    assert tile_chunks(2, 8) == [range(0, 2)]


# --------------------------------------------------------------------------------------------------- padding


def _ramp(height: int, width: int) -> torch.Tensor:
    """(1, 1, H, W) uint8 ramp: value 10*row + col."""
    rows = torch.arange(height)[:, None] * 10
    cols = torch.arange(width)[None, :]
    return (rows + cols).to(torch.uint8)[None, None]


def test_pad_video_reflects() -> None:
    video = _ramp(3, 4)  # rows 0..2, cols 0..3
    padded = pad_video(video, (5, 6))
    assert padded.dtype == torch.uint8
    assert padded.shape == (1, 1, 5, 6)
    expected = torch.tensor(
        [
            [0, 1, 2, 3, 2, 1],
            [10, 11, 12, 13, 12, 11],
            [20, 21, 22, 23, 22, 21],
            [10, 11, 12, 13, 12, 11],  # reflected row 1
            [0, 1, 2, 3, 2, 1],  # reflected row 0
        ],
        dtype=torch.uint8,
    )
    assert torch.equal(padded[0, 0], expected)


def test_pad_video_replicates_when_strip_is_longer_than_source() -> None:
    video = _ramp(3, 4)
    padded = pad_video(video, (6, 5))  # bottom strip 3 >= 3 rows: reflection impossible
    expected = torch.tensor(
        [
            [0, 1, 2, 3, 3],
            [10, 11, 12, 13, 13],
            [20, 21, 22, 23, 23],
            [20, 21, 22, 23, 23],
            [20, 21, 22, 23, 23],
            [20, 21, 22, 23, 23],
        ],
        dtype=torch.uint8,
    )
    assert torch.equal(padded[0, 0], expected)


def test_pad_video_noop_and_refuses_shrinking() -> None:
    video = _ramp(3, 4)
    assert pad_video(video, (3, 4)) is video
    with pytest.raises(ValueError):
        pad_video(video, (2, 4))


def test_crop_output_gives_source_times_scale() -> None:
    grid = tile_grid(60, 100, 2, 0.2)
    assert grid.canvas_size == (512, 768)
    canvas = torch.arange(512 * 768, dtype=torch.int64).reshape(1, 1, 512, 768)
    cropped = crop_output(canvas, grid)
    assert cropped.shape == (1, 1, 120, 200)
    assert torch.equal(cropped, canvas[..., :120, :200])


# --------------------------------------------------------------------------------------------------- blending


@pytest.mark.parametrize(("height", "width"), [(1, 1), (4, 6), (128, 256)])
def test_hann_window_formula(height: int, width: int) -> None:
    window = hann_window_2d(height, width)
    assert window.shape == (height, width)

    def w1d(n: int) -> torch.Tensor:
        k = torch.arange(1, n + 1, dtype=torch.float64)
        return torch.sin(math.pi * k / (n + 2)) ** 2

    expected = w1d(height)[:, None] * w1d(width)[None, :]
    torch.testing.assert_close(window.double(), expected, rtol=0, atol=1e-6)
    assert bool((window > 0).all())


def test_hann_window_small_values() -> None:
    # n = 1: sin^2(pi/3) = 0.75; n = 2: sin^2(pi/4) = 0.5, sin^2(pi/2) = 1.
    window = hann_window_2d(1, 2)
    torch.testing.assert_close(window, torch.tensor([[0.375, 0.75]]), rtol=0, atol=1e-6)


# Landscape, portrait, square and odd sizes; at x2, x4 and the x2.25 route's pre-upscaled sizes; one or many tiles.
COVERAGE_CASES = [
    (height, width, scale, tile_sizes)
    for height, width in [(512, 768), (360, 640), (640, 360), (301, 223), (250, 250), (405, 720), (17, 1001)]
    for scale in (2, 4)
    for tile_sizes in (RESOLUTIONS, TINY_TILE_SIZES)
] + [(*pre_upscale_size(height, width), 2, RESOLUTIONS) for height, width in [(320, 480), (237, 411), (720, 405)]]


@pytest.mark.parametrize(("height", "width", "scale", "tile_sizes"), COVERAGE_CASES)
def test_tile_grid_covers_every_canvas_pixel_with_positive_weight(
    height: int, width: int, scale: int, tile_sizes: tuple[tuple[int, int], ...]
) -> None:
    # The blend divides by the summed Hann weight with no floor, so no canvas pixel may be left at weight 0.
    grid = tile_grid(height, width, scale, 0.2, tile_sizes)
    window = hann_window_2d(*grid.base)
    weight = torch.zeros(grid.canvas_size)
    for index in range(grid.num_tiles):
        top, left = grid.output_origin(index)
        weight[top : top + grid.base[0], left : left + grid.base[1]] += window
    assert bool((weight > 0).all())


def _tiny_grid(height: int, width: int) -> TileGrid:
    return tile_grid(height, width, 2, 0.2, TINY_TILE_SIZES)


def _single_tile_blend(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    grid = _tiny_grid(64, 64)
    assert grid.num_tiles == 1 and grid.base == (128, 128)
    tile = torch.randint(0, 256, (3, 2, 128, 128), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    blender = TileBlender(grid, num_frames=2)
    blender.add(0, tile)
    return tile, blender.result()


def test_blender_single_tile_divides_by_its_weight() -> None:
    tile, out = _single_tile_blend()
    assert out.dtype == torch.uint8 and out.shape == (3, 2, 128, 128)
    # acc = tile*w, wsum = w, trunc(clamp(acc / wsum, 0, 255)): no 1e-6 floor, even where w is below it.
    w = hann_window_2d(128, 128)
    assert bool((w < 1e-6).any())
    expected = ((tile.float() * w) / w).clamp(0, 255).to(torch.uint8)
    assert torch.equal(out, expected)


def test_blender_single_tile_returns_itself() -> None:
    tile, out = _single_tile_blend()
    # The float round trip (x*w)/w then truncation, corners included: never brighter, at most 1 LSB darker.
    diff = tile.int() - out.int()
    assert int(diff.min()) >= 0 and int(diff.max()) <= 1
    assert float((diff == 0).float().mean()) > 0.9


def test_blender_two_constant_tiles() -> None:
    grid = _tiny_grid(64, 96)
    assert grid.lefts == (0, 32) and grid.tops == (0,)
    a, b = 40, 200
    blender = TileBlender(grid, num_frames=1)
    blender.add(0, torch.full((3, 1, 128, 128), a, dtype=torch.uint8))
    blender.add(1, torch.full((3, 1, 128, 128), b, dtype=torch.uint8))
    out = blender.result()
    assert out.shape == (3, 1, 128, 192)
    # Tile 0 covers output columns 0..127, tile 1 columns 64..191.
    overlap = out[..., 64:128]
    assert int(overlap.min()) >= a and int(overlap.max()) <= b
    # Away from its ends, where one weight is nearly 0, the overlap is strictly between the two values.
    inside = out[..., 72:120]
    assert int(inside.min()) > a and int(inside.max()) < b
    # Moving right, tile 1's weight grows relative to tile 0's: the blend increases along the overlap.
    row = out[0, 0, 64, 64:128].int()
    assert bool((row[1:] >= row[:-1]).all())
    # Outside the overlap only one tile contributes (up to the 1-LSB float round trip), corners included.
    assert a - 1 <= int(out[..., :64].min()) and int(out[..., :64].max()) <= a
    assert b - 1 <= int(out[..., 128:].min()) and int(out[..., 128:].max()) <= b


def test_blender_rejects_a_grid_that_leaves_pixels_uncovered() -> None:
    # Output columns 128..191 lie between the two tiles; tile_grid never builds such a grid.
    grid = TileGrid(
        source_size=(64, 160),
        padded_size=(64, 160),
        base=(128, 128),
        tile=(64, 64),
        tiling_scale=2,
        tops=(0,),
        lefts=(0, 96),
    )
    blender = TileBlender(grid, num_frames=1)
    blender.add(0, torch.zeros((3, 1, 128, 128), dtype=torch.uint8))
    blender.add(1, torch.zeros((3, 1, 128, 128), dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"8192 canvas pixels are covered by no tile \(first at row 0, column 128\)"):
        blender.result()


def test_blender_missing_tile_raises() -> None:
    grid = _tiny_grid(64, 96)
    blender = TileBlender(grid, num_frames=1)
    blender.add(0, torch.zeros((3, 1, 128, 128), dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\[1\]"):
        blender.result()


def test_blender_rejects_wrong_shape_and_duplicates() -> None:
    grid = _tiny_grid(64, 96)
    blender = TileBlender(grid, num_frames=1)
    with pytest.raises(ValueError):
        blender.add(0, torch.zeros((3, 1, 128, 64), dtype=torch.uint8))
    blender.add(0, torch.zeros((3, 1, 128, 128), dtype=torch.uint8))
    with pytest.raises(ValueError):
        blender.add(0, torch.zeros((3, 1, 128, 128), dtype=torch.uint8))


def test_blender_crops_padding() -> None:
    # 40x40 pads to 64x64 (one tile): the output is 80x80, not the 128x128 canvas.
    grid = _tiny_grid(40, 40)
    blender = TileBlender(grid, num_frames=1)
    blender.add(0, torch.full((3, 1, 128, 128), 255, dtype=torch.uint8))
    out = blender.result()
    assert out.shape == (3, 1, 80, 80)
    assert int(out.min()) >= 254


# --------------------------------------------------------------------------------------------------- target size


def test_target_fullhd_fit_keeps_result() -> None:
    # 1536x1024 (WxH): k = min(1080/1024, 1920/1536) = 1.055 >= 1 -> kept, with a warning.
    with pytest.warns(UserWarning, match="kept as is"):
        assert target_size(1024, 1536, "fullhd", "fit") is None


def test_target_hd_fit() -> None:
    # k = min(720/1024, 1280/1536) = 0.703125 -> 720 x 1080.
    assert target_size(1024, 1536, "hd", "fit") == (720, 1080)


def test_target_hd_exact_warns_squeeze() -> None:
    with pytest.warns(UserWarning, match="squeezes"):
        assert target_size(1024, 1536, "hd", "exact") == (720, 1280)


def test_target_exact_matching_aspect_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert target_size(1440, 2560, "hd", "exact") == (720, 1280)


def test_target_exact_larger_than_result_raises() -> None:
    with pytest.raises(ValueError, match="larger"):
        target_size(1024, 1536, "2k", "exact")
    with pytest.raises(ValueError, match="larger"):
        target_size(1024, 1536, "2000x1000", "exact")


def test_target_wxh_spec() -> None:
    # "640x400" is W x H: bucket (400, 640); k = min(400/1024, 640/1536) = 0.390625 -> 400 x 600.
    assert target_size(1024, 1536, "640x400", "fit") == (400, 600)
    with pytest.warns(UserWarning, match="squeezes"):
        assert target_size(1024, 1536, "640x400", "exact") == (400, 640)
    # Same aspect as the result: exactly that size.
    assert target_size(1024, 1536, "768x512", "fit") == (512, 768)


def test_target_portrait_and_square_buckets() -> None:
    # Portrait 1024x1536 (WxH) -> hd portrait bucket (1280, 720): k = 720/1024 -> 1080 x 720.
    assert target_size(1536, 1024, "hd", "fit") == (1080, 720)
    # Square -> (720, 720) bucket.
    assert target_size(1000, 1000, "hd", "fit") == (720, 720)
    assert target_size(2000, 2000, "2k", "fit") == (1440, 1440)
    # Fit sizes are even: 1001x1001 * 0.7193 -> 720.
    assert target_size(1001, 1001, "hd", "fit") == (720, 720)


def test_target_fit_even_rounding() -> None:
    # 1000x1600 (HxW) into hd (720, 1280): k = min(0.72, 0.8) = 0.72 -> 720 x 1152.
    assert target_size(1000, 1600, "hd", "fit") == (720, 1152)
    # 999x1333 has ratio 1.334, closer to 1 than to 16/9: square bucket (720, 720); k = 720/1333 = 0.540135
    # -> H round(539.6/2)*2 = 540, W 720.
    assert target_size(999, 1333, "hd", "fit") == (540, 720)


def test_target_none_keeps_result() -> None:
    # Unknown tiers and modes never get here: `UpscaleParams` refuses them (tests/contract/test_params.py).
    assert target_size(1024, 1536, None) is None


def test_resolutions_are_the_released_ones() -> None:
    assert RESOLUTIONS == ((512, 512), (512, 768), (768, 512))
