"""Which source frames a clip keeps and the rate they play at: the contract's 24-fps rule and the model's 1 + 8k."""

from __future__ import annotations

import math
import warnings

TARGET_FPS = 24
MAX_NUM_FRAMES = 121
RESAMPLE_FPS_TOLERANCE = 1.5

# The model only accepts clips of 1 + 8k frames.
_FRAME_GROUP = 8


def aligned_frame_count(num_frames: int) -> int:
    """Largest ``1 + 8k`` that does not exceed ``num_frames``."""
    if num_frames < 1:
        raise ValueError(f"need at least one frame, got {num_frames}")
    return 1 + _FRAME_GROUP * ((num_frames - 1) // _FRAME_GROUP)


def _kept_indices(num_frames: int, source_fps: float, cap: int | None) -> tuple[list[int], int]:
    """The 24-fps selection rule over the first `cap` kept frames (all of them when `cap` is None)."""
    if num_frames < 1:
        raise ValueError(f"need at least one frame, got {num_frames}")
    if not math.isfinite(source_fps) or source_fps <= 0:
        raise ValueError(f"source frame rate must be positive, got {source_fps}")
    limit = num_frames if cap is None else min(num_frames, cap)

    if abs(source_fps - TARGET_FPS) < RESAMPLE_FPS_TOLERANCE:
        indices = list(range(limit))
        fps = round(source_fps)
    elif source_fps > TARGET_FPS:
        step = source_fps / TARGET_FPS
        # Indices grow with i, so capping the loop first keeps the same prefix.
        count = int(num_frames / step) if cap is None else min(int(num_frames / step), cap)
        indices = [k for k in (round(i * step) for i in range(count)) if k < num_frames]
        fps = TARGET_FPS
    else:
        # max(1, ...) keeps sub-0.5 fps slideshows writable as a valid stream rate.
        fps = max(1, round(source_fps))
        warnings.warn(
            f"source frame rate {source_fps:g} fps is below {TARGET_FPS} fps; keeping "
            f"every frame at {fps} fps (no motion interpolation is done)",
            stacklevel=3,
        )
        indices = list(range(limit))

    if not indices:
        raise ValueError(
            f"no frames kept: {num_frames} frame(s) at {source_fps:g} fps is shorter "
            f"than one {TARGET_FPS} fps output frame"
        )
    return indices, fps


def select_frames(num_frames: int, source_fps: float) -> tuple[list[int], int]:
    """Choose which source frames to keep and the frame rate they play at (the contract's rule).

    - Within ``RESAMPLE_FPS_TOLERANCE`` of 24 fps: keep every frame and play at
      the rounded source rate (23.976 -> 24, 25 -> 25), since dropping frames to
      reach exactly 24 would cause visible judder for no gain.
    - Faster: drop frames on a fixed stride of ``source_fps / 24`` (nearest
      frame, Python's half-to-even rounding) and play at 24 fps.
    - Slower: keep every frame at the rounded native rate, because there is no
      motion interpolation to invent missing frames; a warning says so.

    The kept list is then cut to ``MAX_NUM_FRAMES`` and floored to ``1 + 8k``.
    Raises ``ValueError`` when nothing would be kept.
    """
    indices, fps = _kept_indices(num_frames, source_fps, MAX_NUM_FRAMES)
    return indices[: aligned_frame_count(len(indices))], fps


def select_all_frames(num_frames: int, source_fps: float, max_frames: int | None = None) -> tuple[list[int], int]:
    """Every frame the 24-fps rule of :func:`select_frames` keeps, whatever the length (or the first
    ``max_frames``), with no ``1 + 8k`` flooring: the whole-video selection."""
    return _kept_indices(num_frames, source_fps, max_frames)
