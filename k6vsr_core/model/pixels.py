"""The tensor side of the tile grid (`k6vsr_core.contract.tiling`): pre-upscale, padding, Hann blending and resizing.

Apart from the grid's geometry so that planning, which only needs sizes, never imports torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k6vsr_core.contract.tiling import Size, TileGrid, pre_upscale_size

RESIZE_FRAME_CHUNK = 8


def pre_upscale_video(video: torch.Tensor) -> torch.Tensor:
    """x1.125 bilinear pre-upscale of a uint8 `(T, C, H, W)` clip, re-quantised to uint8 (contract §A.5)."""
    size = pre_upscale_size(video.shape[-2], video.shape[-1])
    resized = F.interpolate(video.float(), size=size, mode="bilinear", align_corners=False, antialias=False)
    return resized.round().clamp(0, 255).to(torch.uint8)


def pad_video(video: torch.Tensor, padded: Size) -> torch.Tensor:
    """Pad a uint8 `(T, C, H, W)` clip bottom/right to `padded`: reflect, or replicate where the strip is too long."""
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
    """Hann-weighted average of uint8 tiles on the padded canvas (contract §E).

    Tiles are added in the order given; callers add them in tile order so that every runtime sums identically.
    """

    def __init__(self, grid: TileGrid, num_frames: int, channels: int = 3) -> None:
        self.grid = grid
        canvas = grid.canvas_size
        self.window = hann_window_2d(*grid.base)
        self.acc = torch.zeros((channels, num_frames, *canvas), dtype=torch.float32)
        self.weight = torch.zeros(canvas, dtype=torch.float32)
        self.added: set[int] = set()

    def add(self, index: int, tile: torch.Tensor) -> None:
        """Add tile `index`, a uint8 `(C, T, base_h, base_w)` tensor."""
        expected = (self.acc.shape[0], self.acc.shape[1], *self.grid.base)
        if tuple(tile.shape) != expected:
            raise ValueError(f"tile {index} has shape {tuple(tile.shape)}, expected {expected}")
        if index in self.added:
            raise ValueError(f"tile {index} was already blended")
        top, left = self.grid.output_origin(index)
        bh, bw = self.grid.base
        self.acc[:, :, top : top + bh, left : left + bw] += tile.float() * self.window
        self.weight[top : top + bh, left : left + bw] += self.window
        self.added.add(index)

    def result(self) -> torch.Tensor:
        """The blended canvas, cropped to source x scale, as uint8 `(C, T, H, W)` (truncated, as the official).

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
        return crop_output(blended.clamp(0, 255).to(torch.uint8), self.grid)


def resize_video(video: torch.Tensor, size: Size) -> torch.Tensor:
    """Antialiased bilinear downscale of a uint8 `(C, T, H, W)` clip, in 8-frame chunks to bound memory."""
    channels, frames = video.shape[0], video.shape[1]
    out = torch.empty((channels, frames, *size), dtype=torch.uint8)
    for start in range(0, frames, RESIZE_FRAME_CHUNK):
        chunk = video[:, start : start + RESIZE_FRAME_CHUNK].permute(1, 0, 2, 3).float()
        resized = F.interpolate(chunk, size=size, mode="bilinear", antialias=True, align_corners=False)
        out[:, start : start + RESIZE_FRAME_CHUNK] = resized.clamp(0, 255).round().to(torch.uint8).permute(1, 0, 2, 3)
    return out
