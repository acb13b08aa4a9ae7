"""Geometry of the tiled SR pass: trained tile sizes, padding, the tile grid and delivery sizes.

The DiT only ever sees the tile sizes it was trained on, so every clip is cut into overlapping tiles of one of
those sizes (chosen by aspect), refined tile by tile, and blended back with Hann windows. All rules here follow the
official pipeline (contract §A.4, §A.5, §B, §E, §F) and are pure: sizes in, sizes out; the pixels themselves are
`k6vsr_core.model.pixels`, so planning needs no torch. Worked example, 512x768 (HxW) at x2: base (512, 768), LR tile
256x384, tops (0, 128, 256), lefts (0, 192, 384): 3x3 tiles.

Sizes are always (height, width) pairs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

# The trained tile sizes (H, W) of the released checkpoints (OFF `RESOLUTIONS[512]`, DF-dit `tile_sizes`).
RESOLUTIONS: tuple[tuple[int, int], ...] = ((512, 512), (512, 768), (768, 512))
# KVAE spatial stride: one latent pixel per 16x16 source pixels.
SPATIAL_FACTOR = 16
PRE_UPSCALE = 1.125
# Delivery tiers, (H, W) per orientation: landscape, square, portrait (OFF `TARGET_RESOLUTIONS`).
TARGET_RESOLUTIONS: dict[str, tuple[tuple[int, int], ...]] = {
    "hd": ((720, 1280), (720, 720), (1280, 720)),
    "fullhd": ((1080, 1920), (1080, 1080), (1920, 1080)),
    "2k": ((1440, 2560), (1440, 1440), (2560, 1440)),
}
ASPECT_MISMATCH_TOLERANCE = 0.02
PADDING_ITERATIONS = 3

Size = tuple[int, int]


def ceil_to_multiple(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def closest_base(height: int, width: int, tile_sizes: Sequence[Size] = RESOLUTIONS) -> Size:
    """The trained tile size whose aspect is closest to `width / height`; ties go to the first listed."""
    if height <= 0 or width <= 0:
        raise ValueError(f"size {height}x{width} (HxW) must be positive")
    ratio = width / height
    best = min(tile_sizes, key=lambda hw: abs(hw[1] / hw[0] - ratio))
    return int(best[0]), int(best[1])


def lr_tile_size(base: Size, tiling_scale: int) -> Size:
    """The low-resolution tile that becomes exactly `base` after the latent upscaler."""
    if base[0] % (SPATIAL_FACTOR * tiling_scale) or base[1] % (SPATIAL_FACTOR * tiling_scale):
        raise ValueError(f"tile size {base} is not divisible by {SPATIAL_FACTOR * tiling_scale} (16 x scale)")
    return base[0] // tiling_scale, base[1] // tiling_scale


def pre_upscale_size(height: int, width: int) -> Size:
    """Size of the x1.125 pre-upscale of the x2.25 route, snapped to the 16-px stride (contract §A.5)."""
    return (
        max(SPATIAL_FACTOR, round(height * PRE_UPSCALE / SPATIAL_FACTOR) * SPATIAL_FACTOR),
        max(SPATIAL_FACTOR, round(width * PRE_UPSCALE / SPATIAL_FACTOR) * SPATIAL_FACTOR),
    )


def axis_positions(length: int, tile: int, min_overlap: float, snap: int = SPATIAL_FACTOR) -> tuple[int, ...]:
    """Evenly spread tile starts on one axis: the fewest tiles whose uniform overlap is at least `min_overlap`.

    Positions are whole multiples of `snap` when both `length` and `tile` are (so tiles align with the latent
    grid), else of 1. Rounding is Python's half-to-even, as in the official grid.
    """
    if tile <= 0 or length <= 0:
        raise ValueError(f"length {length} and tile {tile} must be positive")
    if tile >= length:
        return (0,)
    unit = snap if length % snap == 0 and tile % snap == 0 else 1
    span = (length - tile) // unit
    max_stride = max(1, math.floor(tile * (1.0 - min_overlap) / unit))
    count = math.ceil(span / max_stride) + 1
    return tuple(round(index * span / (count - 1)) * unit for index in range(count))


def padded_size(height: int, width: int, tiling_scale: int, tile_sizes: Sequence[Size] = RESOLUTIONS) -> Size:
    """The source size after bottom/right padding: on the 16-px stride and at least one LR tile per axis.

    The tile depends on the aspect of the padded size, so the target is re-evaluated until stable (at most 3
    times, as the official pipeline does).
    """
    target = (ceil_to_multiple(height, SPATIAL_FACTOR), ceil_to_multiple(width, SPATIAL_FACTOR))
    for _ in range(PADDING_ITERATIONS):
        tile = lr_tile_size(closest_base(*target, tile_sizes), tiling_scale)
        candidate = (
            max(target[0], ceil_to_multiple(tile[0], SPATIAL_FACTOR)),
            max(target[1], ceil_to_multiple(tile[1], SPATIAL_FACTOR)),
        )
        if candidate == target:
            break
        target = candidate
    return target


class TileGrid(BaseModel):
    """Where every tile sits, in LR pixels, latent pixels and output pixels. Tiles are numbered row-major."""

    model_config = ConfigDict(frozen=True)

    source_size: Size  # after the optional pre-upscale, before padding
    padded_size: Size
    base: Size  # trained tile size = output tile size
    tile: Size  # LR tile size
    tiling_scale: int
    tops: tuple[int, ...]
    lefts: tuple[int, ...]

    @property
    def num_tiles(self) -> int:
        return len(self.tops) * len(self.lefts)

    @property
    def positions(self) -> list[Size]:
        return [(top, left) for top in self.tops for left in self.lefts]

    @property
    def padding(self) -> Size:
        """(bottom, right) padding in source pixels."""
        return self.padded_size[0] - self.source_size[0], self.padded_size[1] - self.source_size[1]

    @property
    def canvas_size(self) -> Size:
        return self.padded_size[0] * self.tiling_scale, self.padded_size[1] * self.tiling_scale

    @property
    def output_size(self) -> Size:
        """The SR result after cropping the padding away: exactly source x scale."""
        return self.source_size[0] * self.tiling_scale, self.source_size[1] * self.tiling_scale

    @property
    def latent_tile(self) -> Size:
        return self.tile[0] // SPATIAL_FACTOR, self.tile[1] // SPATIAL_FACTOR

    def latent_slices(self, index: int) -> tuple[slice, slice]:
        top, left = self.positions[index]
        th, tw = self.latent_tile
        return (
            slice(top // SPATIAL_FACTOR, top // SPATIAL_FACTOR + th),
            slice(left // SPATIAL_FACTOR, left // SPATIAL_FACTOR + tw),
        )

    def output_origin(self, index: int) -> Size:
        top, left = self.positions[index]
        return top * self.tiling_scale, left * self.tiling_scale


def tile_grid(
    height: int,
    width: int,
    tiling_scale: int,
    min_overlap: float,
    tile_sizes: Sequence[Size] = RESOLUTIONS,
) -> TileGrid:
    """The grid for a (pre-upscaled) source of `height x width` pixels."""
    padded = padded_size(height, width, tiling_scale, tile_sizes)
    base = closest_base(*padded, tile_sizes)
    tile = lr_tile_size(base, tiling_scale)
    return TileGrid(
        source_size=(height, width),
        padded_size=padded,
        base=base,
        tile=tile,
        tiling_scale=tiling_scale,
        tops=axis_positions(padded[0], tile[0], min_overlap),
        lefts=axis_positions(padded[1], tile[1], min_overlap),
    )


def tile_chunks(num_tiles: int, tiles_batch_size: int) -> list[range]:
    """Consecutive tile chunks; a chunk is one DiT batch and one seeding unit (seed + its first index)."""
    return [range(start, min(start + tiles_batch_size, num_tiles)) for start in range(0, num_tiles, tiles_batch_size)]


def _bucket(spec: str, sr_height: int, sr_width: int) -> Size:
    if spec in TARGET_RESOLUTIONS:
        ratio = sr_width / sr_height
        return min(TARGET_RESOLUTIONS[spec], key=lambda hw: abs(hw[1] / hw[0] - ratio))
    width, height = (int(part) for part in spec.split("x"))
    return height, width


def target_size(sr_height: int, sr_width: int, spec: str | None, mode: str = "fit") -> Size | None:
    """The delivery (H, W) for a tier or `WxH` spec, or None when the SR result is kept as is (contract §F).

    `spec` and `mode` are as `UpscaleParams` validated them (a tier name or `WxH`; `fit` or `exact`). `fit` shrinks
    isotropically into the bucket (even sizes, never upscales); `exact` returns the bucket itself and refuses one
    larger than the SR result on either axis.
    """
    if spec is None:
        return None
    bucket = _bucket(spec, sr_height, sr_width)
    if mode == "exact":
        if bucket[0] > sr_height or bucket[1] > sr_width:
            raise ValueError(
                f"target {bucket[1]}x{bucket[0]} (WxH) is larger than the SR result {sr_width}x{sr_height}; "
                "exact mode never upscales: pick a lower tier or a higher scale"
            )
        source_ratio, target_ratio = sr_width / sr_height, bucket[1] / bucket[0]
        if abs(source_ratio - target_ratio) / target_ratio > ASPECT_MISMATCH_TOLERANCE:
            warnings.warn(
                f"target {bucket[1]}x{bucket[0]} squeezes the {sr_width}x{sr_height} result by "
                f"{abs(source_ratio / target_ratio - 1) * 100:.1f}%",
                stacklevel=2,
            )
        return None if bucket == (sr_height, sr_width) else bucket
    factor = min(bucket[0] / sr_height, bucket[1] / sr_width)
    if factor >= 1.0:
        warnings.warn(
            f"the {sr_width}x{sr_height} result already fits in {bucket[1]}x{bucket[0]}; it is kept as is",
            stacklevel=2,
        )
        return None
    return (
        min(bucket[0], round(sr_height * factor / 2) * 2),
        min(bucket[1], round(sr_width * factor / 2) * 2),
    )
