"""Time windows: how a video of any length is cut into the 121-frame windows the model was trained on, and joined.

Windows are spread evenly over the kept frames, as tiles are over a frame: the fewest windows of `WINDOW_FRAMES`
whose neighbours overlap by at least `overlap` frames, the first starting on the first frame and the last ending on
the last. A clip no longer than one window is one window, padded at its end to `1 + 8k` frames by repeating its last
frame (and cropped back after decoding), as space is padded and cropped.

Neighbours are cross-faded in pixel space over their overlap with a raised-cosine ramp. The output is written as
one encoded segment per window: segment `w` holds the frames from the start of window `w` to the start of window
`w + 1`, beginning with the cross-fade from window `w - 1` (cut at the segment's end when window `w + 1` starts
before window `w - 1` ends), so it needs only windows `w - 1` and `w`.

With scene windows (`windows='scenes'`), the kept frames are first cut into shots at the source's scene cuts
(`k6vsr_core.contract.scenes`), and each shot is windowed as above on its own: a shot no longer than one window is one
window,
padded to `1 + 8k` as a short clip is. No window holds frames of two shots, so neighbours across a cut share no frame
and nothing is cross-faded there: the cut stays a hard cut.

Seeds: the noise of a tile chunk is drawn from `seed + first tile of the chunk` in every window, the contract's
seeding (the first window's noise is exactly the contract's). A window's result then depends only on its frames:
where the picture does not change across a seam, the two windows compute the same pixels and the seam cannot show.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, ConfigDict

WINDOW_FRAMES = 121  # the trained length, 1 + 8 * 15
FRAME_GROUP = 8  # a window holds 1 + 8k frames
# Beyond half a window, three windows would share frames.
MAX_OVERLAP = WINDOW_FRAMES // 2


class Window(BaseModel):
    """Frames `start` to `stop` (exclusive) of the kept frames, computed as `padded` frames."""

    model_config = ConfigDict(frozen=True)

    index: int
    start: int
    stop: int
    padded: int  # 1 + 8k >= stop - start; the tail repeats the last frame

    @property
    def frames(self) -> int:
        return self.stop - self.start


def padded_length(frames: int) -> int:
    """The smallest `1 + 8k` that holds `frames` frames."""
    if frames < 1:
        raise ValueError(f"a window needs at least one frame, got {frames}")
    return 1 + FRAME_GROUP * math.ceil((frames - 1) / FRAME_GROUP)


def plan_windows(num_frames: int, overlap: int, window: int = WINDOW_FRAMES) -> tuple[Window, ...]:
    """Evenly spread windows over `num_frames` frames, neighbours sharing at least `overlap` frames."""
    if num_frames < 1:
        raise ValueError(f"need at least one frame, got {num_frames}")
    if not 0 <= overlap <= min(MAX_OVERLAP, window // 2):
        raise ValueError(f"window overlap {overlap} is out of range; allowed: 0 to {min(MAX_OVERLAP, window // 2)}")
    if num_frames <= window:
        return (Window(index=0, start=0, stop=num_frames, padded=padded_length(num_frames)),)
    count = math.ceil((num_frames - overlap) / (window - overlap))
    span = num_frames - window
    # Python's half-to-even rounding, as the tile positions; starts strictly increase since span / (count-1) >= 1.
    starts = [round(index * span / (count - 1)) for index in range(count)]
    return tuple(Window(index=i, start=s, stop=s + window, padded=window) for i, s in enumerate(starts))


def shot_ranges(num_frames: int, cuts: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The shots `[start, stop)` of `num_frames` frames cut before each frame in `cuts` (ascending, inside)."""
    if any(not 0 < cut < num_frames for cut in cuts) or list(cuts) != sorted(set(cuts)):
        raise ValueError(f"scene cuts {list(cuts)} are not ascending positions inside 1 to {num_frames - 1}")
    bounds = (0, *cuts, num_frames)
    return tuple(zip(bounds, bounds[1:], strict=False))


def plan_scene_windows(
    num_frames: int, overlap: int, cuts: tuple[int, ...], window: int = WINDOW_FRAMES
) -> tuple[Window, ...]:
    """`plan_windows` within each shot: no window spans a cut, so no cross-fade does."""
    if num_frames < 1:
        raise ValueError(f"need at least one frame, got {num_frames}")
    windows: list[Window] = []
    for start, stop in shot_ranges(num_frames, cuts):
        for shot_window in plan_windows(stop - start, overlap, window):
            windows.append(
                Window(
                    index=len(windows),
                    start=start + shot_window.start,
                    stop=start + shot_window.stop,
                    padded=shot_window.padded,
                )
            )
    return tuple(windows)


class Shot(BaseModel):
    """Frames `start` to `stop` of the kept frames between two cuts (or the clip's ends), and the windows that hold
    them. A shot shorter than a window is one window of its own, computed as `padded` frames (its last frame
    repeated, cropped back) as a short clip is, and joined to its neighbours by a hard cut, never a cross-fade."""

    model_config = ConfigDict(frozen=True)

    index: int
    start: int
    stop: int
    windows: tuple[int, ...]

    @property
    def frames(self) -> int:
        return self.stop - self.start


def plan_shots(windows: tuple[Window, ...], cuts: tuple[int, ...]) -> tuple[Shot, ...]:
    """The shots of a plan's windows cut before each of `cuts`, each with the windows inside it."""
    shots = []
    for index, (start, stop) in enumerate(shot_ranges(windows[-1].stop, cuts)):
        inside = tuple(w.index for w in windows if start <= w.start and w.stop <= stop)
        if not inside or windows[inside[0]].start != start or windows[inside[-1]].stop != stop:
            raise ValueError(f"the windows do not cover shot {index} (frames {start} to {stop}) on their own")
        shots.append(Shot(index=index, start=start, stop=stop, windows=inside))
    return tuple(shots)


def shares_frames(windows: tuple[Window, ...], index: int) -> bool:
    """Window `index` shares frames with the one before it: its segment begins with their cross-fade."""
    return index > 0 and windows[index - 1].stop > windows[index].start


def segment_range(windows: tuple[Window, ...], index: int) -> tuple[int, int]:
    """The frames segment `index` holds: from its window's start to the next window's start (or the end)."""
    end = windows[index + 1].start if index + 1 < len(windows) else windows[index].stop
    return windows[index].start, end


def fade_in(length: int) -> np.ndarray:
    """Weights of the later window across an overlap of `length` frames: a raised cosine strictly inside (0, 1)."""
    k = np.arange(1, length + 1, dtype=np.float64)
    return (0.5 - 0.5 * np.cos(np.pi * k / (length + 1))).astype(np.float32)


def crossfade(earlier: np.ndarray, later: np.ndarray) -> np.ndarray:
    """Blend two renderings `(T, H, W, C)` of the same frames (uint8, or uint16 on the 16-bit path), from all
    `earlier` to all `later`."""
    if earlier.shape != later.shape or earlier.dtype != later.dtype:
        raise ValueError(f"cannot cross-fade frames of {earlier.dtype} {earlier.shape} and {later.dtype} {later.shape}")
    weight = fade_in(earlier.shape[0])[:, None, None, None]
    mixed = earlier.astype(np.float32) * (1.0 - weight) + later.astype(np.float32) * weight
    return np.clip(np.rint(mixed), 0, np.iinfo(earlier.dtype).max).astype(earlier.dtype)


def segment_frames(
    windows: tuple[Window, ...], index: int, current: np.ndarray, previous: np.ndarray | None
) -> np.ndarray:
    """Segment `index` from its window's frames (`current`, all of them) and the previous window's (or None)."""
    window = windows[index]
    start, end = segment_range(windows, index)
    if current.shape[0] != window.frames:
        raise ValueError(f"window {index} has {current.shape[0]} frames, expected {window.frames}")
    own = current[: end - start]
    if not shares_frames(windows, index):
        return own
    before = windows[index - 1]
    if previous is None or previous.shape[0] != before.frames:
        raise ValueError(f"segment {index} needs the {before.frames} frames of window {index - 1}")
    # The fade ends where the next segment starts, even when three windows share frames: joins stay pairwise.
    shared = min(before.stop, end) - start
    offset = start - before.start
    faded = crossfade(previous[offset : offset + shared], own[:shared])
    return np.concatenate([faded, own[shared:]]) if shared < own.shape[0] else faded
