"""The tensor side of the tile grid (`k6vsr_core.contract.tiling`): pre-upscale, padding, Hann blending and resizing.

Apart from the grid's geometry so that planning, which only needs sizes, never imports torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k6vsr_core.contract.tiling import Size, TileGrid, pre_upscale_size

RESIZE_FRAME_CHUNK = 8


def requantised(values: torch.Tensor, dtype: torch.dtype, truncate: bool = False) -> torch.Tensor:
    """Float pixels back to `dtype` (uint8, or uint16 on the 16-bit path), clamped to its range: rounded, or
    truncated as the official blend does."""
    values = values.clamp(0, torch.iinfo(dtype).max)
    return (values if truncate else values.round()).to(dtype)


def pre_upscale_video(video: torch.Tensor) -> torch.Tensor:
    """x1.125 bilinear pre-upscale of a `(T, C, H, W)` clip, re-quantised to its dtype (contract §A.5)."""
    size = pre_upscale_size(video.shape[-2], video.shape[-1])
    resized = F.interpolate(video.float(), size=size, mode="bilinear", align_corners=False, antialias=False)
    return requantised(resized, video.dtype)


def pad_video(video: torch.Tensor, padded: Size) -> torch.Tensor:
    """Pad a `(T, C, H, W)` clip bottom/right to `padded`: reflect, or replicate where the strip is too long."""
    height, width = video.shape[-2:]
    bottom, right = padded[0] - height, padded[1] - width
    if bottom < 0 or right < 0:
        raise ValueError(f"cannot pad {height}x{width} down to {padded}")
    if bottom == 0 and right == 0:
        return video
    # Reflection cannot produce a strip as long as the source itself.
    mode = "reflect" if bottom < height and right < width else "replicate"
    return F.pad(video.float(), (0, right, 0, bottom), mode=mode).to(video.dtype)


def crop_output(video: torch.Tensor, grid: TileGrid) -> torch.Tensor:
    """Remove the scaled padding from a `(..., H, W)` canvas."""
    height, width = grid.output_size
    return video[..., :height, :width]


def hann_window_2d(height: int, width: int) -> torch.Tensor:
    """Outer product of Hann windows with their zero ends dropped, so every covered pixel has positive weight."""
    window_y = torch.hann_window(height + 2, dtype=torch.float32)[1:-1]
    window_x = torch.hann_window(width + 2, dtype=torch.float32)[1:-1]
    return window_y[:, None] * window_x[None, :]


class TileBlender:
    """Hann-weighted average of pixel tiles (all uint8, or all uint16) on the padded canvas (contract §E).

    Tiles are added in the order given; callers add them in tile order so that every runtime sums identically.
    """

    def __init__(self, grid: TileGrid, num_frames: int, channels: int = 3) -> None:
        self.grid = grid
        canvas = grid.canvas_size
        self.window = hann_window_2d(*grid.base)
        self.acc = torch.zeros((channels, num_frames, *canvas), dtype=torch.float32)
        self.weight = torch.zeros(canvas, dtype=torch.float32)
        self.added: set[int] = set()
        self.dtype: torch.dtype | None = None  # the tiles', set by the first

    def add(self, index: int, tile: torch.Tensor) -> None:
        """Add tile `index`, a `(C, T, base_h, base_w)` tensor of pixels."""
        expected = (self.acc.shape[0], self.acc.shape[1], *self.grid.base)
        if tuple(tile.shape) != expected:
            raise ValueError(f"tile {index} has shape {tuple(tile.shape)}, expected {expected}")
        if self.dtype is not None and tile.dtype != self.dtype:
            raise ValueError(f"tile {index} is {tile.dtype}, the tiles before it {self.dtype}")
        self.dtype = tile.dtype
        if index in self.added:
            raise ValueError(f"tile {index} was already blended")
        top, left = self.grid.output_origin(index)
        bh, bw = self.grid.base
        self.acc[:, :, top : top + bh, left : left + bw] += tile.float() * self.window
        self.weight[top : top + bh, left : left + bw] += self.window
        self.added.add(index)

    def result(self) -> torch.Tensor:
        """The blended canvas, cropped to source x scale, as `(C, T, H, W)` of the tiles' dtype (truncated, as the
        official).

        Every pixel is the weighted mean of the tiles covering it. The official code divides by `max(weight, 1e-6)`
        instead; near the frame corners, where one tile's outermost Hann weights multiply to less than 1e-6, that
        floor darkens the pixels, so k6vsr divides by the weight itself, as SGLang does.
        """
        missing = set(range(self.grid.num_tiles)) - self.added
        if missing:
            raise ValueError(f"cannot blend: tiles {sorted(missing)} are missing")
        uncovered = (self.weight <= 0).nonzero()
        if len(uncovered):
            row, column = uncovered[0].tolist()
            raise ValueError(
                f"cannot blend: {len(uncovered)} canvas pixels are covered by no tile (first at row {row}, column "
                f"{column}); the tile grid must cover the canvas"
            )
        blended = self.acc / self.weight
        return crop_output(requantised(blended, self.dtype or torch.uint8, truncate=True), self.grid)


def resize_video(video: torch.Tensor, size: Size) -> torch.Tensor:
    """Antialiased bilinear downscale of a `(C, T, H, W)` clip, in 8-frame chunks to bound memory, rounded to its
    dtype."""
    channels, frames = video.shape[0], video.shape[1]
    out = torch.empty((channels, frames, *size), dtype=video.dtype)
    for start in range(0, frames, RESIZE_FRAME_CHUNK):
        chunk = video[:, start : start + RESIZE_FRAME_CHUNK].permute(1, 0, 2, 3).float()
        resized = F.interpolate(chunk, size=size, mode="bilinear", antialias=True, align_corners=False)
        out[:, start : start + RESIZE_FRAME_CHUNK] = requantised(resized, video.dtype).permute(1, 0, 2, 3)
    return out
