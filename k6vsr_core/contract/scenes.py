"""Scene cuts: where a source's shots change, so that no window mixes two shots (`k6vsr_core.contract.windows`).

Every kept frame (those the output holds, after the 24-fps rule) is scaled to `DETECT_WIDTH` pixels wide, whatever
the source's size, so a cut scores the same in a small clip and a large one, and compared with the frame before it:

- **The change** is the mean absolute difference of the two frames in CIE Lab (0-255 a channel) after the camera's
  motion between them is taken out: the earlier frame is shifted by the best of three guesses (no motion, OpenCV's
  phase correlation of the lightness, and the shift found for the pair before, which holds the pan that phase
  correlation loses when the picture moves a third of its width a frame), and only the part both frames see is
  compared. A pan or a tracking shot then changes little; a cut changes everything, be it in colour, lightness,
  texture or where the camera looks. Lab has no hue to go wild in a dark frame, as HSV's does in a fade.
- **A cut** is a frame whose change is at least `CUT_FLOOR` and `CUT_RATIO` times the median change of its
  `NEIGHBOURS` neighbours on each side: a fade or a dissolve changes as much every frame, so no frame of it stands
  out; two cuts a frame apart do (a median is not moved by one other spike).
- **A flash** is not a cut: where a frame up to `FLASH_FRAMES` after the candidate matches the frame before it
  again (its change from that frame under `CUT_FLOOR` and a third of the candidate's), the picture came back, and
  nothing in between cuts.

There is no shortest shot: a shot of one frame is a shot (it gets a window of its own, `k6vsr_core.contract.windows`).

Measured on the labelled synthetic set of `tests/scene_set.py` (40 hard cuts of five kinds 1, 8 and 60 frames apart,
fades, dissolves, flashes and fast pans, at two sizes, H.264 CRF 28; `bench/scene_accuracy.py`): recall 1.00,
precision 1.00, and the same for every floor from 4 to 10 and ratio from 2 to 6. PySceneDetect's detectors on the
same set, each without a shortest shot so that cuts a frame apart can be found at all: content (threshold 27) recall
0.82, precision 0.20 (pans and flashes); adaptive 0.82 / 0.73; histogram 0.57 / 0.31; hash 0.55 / 0.12; content with
its defaults (a shortest shot of 15) 0.30 / 0.75. None compensates motion, which is what separates a pan from a cut
here, so the detector is this module's, on OpenCV's colour conversion and phase correlation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import cv2
import numpy as np

from k6vsr_core import media

DETECT_WIDTH = 128
CUT_FLOOR = 6.0
CUT_RATIO = 3.0
NEIGHBOURS = 3
FLASH_FRAMES = 3
# Frames after a candidate that its decision needs: its neighbours and a flash's end, each change final (the next
# pair's motion is tried on it too).
LAG = max(NEIGHBOURS, FLASH_FRAMES) + 1
# A shift that leaves less than this part of the frame seen by both frames is not believed.
MIN_SHARED = 1 / 3

Shift = tuple[float, float]


def detection_frame(frame: np.ndarray) -> np.ndarray:
    """An RGB uint8 frame as the detector compares it: `DETECT_WIDTH` wide (aspect kept), CIE Lab, float32."""
    height, width = frame.shape[:2]
    size = (DETECT_WIDTH, max(2, round(height * DETECT_WIDTH / width)))
    if (width, height) != size:
        interpolation = cv2.INTER_AREA if width > DETECT_WIDTH else cv2.INTER_LINEAR
        frame = cv2.resize(np.ascontiguousarray(frame), size, interpolation=interpolation)
    return cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2LAB).astype(np.float32)


def shifted_change(earlier: np.ndarray, later: np.ndarray, shift: Shift) -> float:
    """Mean absolute Lab difference of `later` and `earlier` moved by `shift` (x, y), over the part both see;
    infinite when they share too little."""
    height, width = earlier.shape[:2]
    dx, dy = shift
    # The moved frame holds `earlier` only where x - dx and y - dy fall inside it (a pixel's margin for the blend).
    x0, x1 = (int(np.ceil(dx)) + 1, width) if dx >= 0 else (0, width - int(np.ceil(-dx)) - 1)
    y0, y1 = (int(np.ceil(dy)) + 1, height) if dy >= 0 else (0, height - int(np.ceil(-dy)) - 1)
    if x1 - x0 < width * MIN_SHARED or y1 - y0 < height * MIN_SHARED:
        return float("inf")
    if shift != (0.0, 0.0):
        earlier = cv2.warpAffine(earlier, np.array([[1, 0, dx], [0, 1, dy]], dtype=np.float32), (width, height))
    return float(np.abs(earlier[y0:y1, x0:x1] - later[y0:y1, x0:x1]).mean())


class _Comparer:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self._window = cv2.createHanningWindow((shape[1], shape[0]), cv2.CV_32F)

    def change(self, earlier: np.ndarray, later: np.ndarray, motion: Shift) -> tuple[float, Shift]:
        """The change from `earlier` to `later` with the camera's motion taken out, and that motion: the best of no
        motion, the phase correlation's and `motion` (the last pair's, scaled to the frames' distance)."""
        found, _ = cv2.phaseCorrelate(earlier[..., 0], later[..., 0], self._window)
        guesses: list[Shift] = [(0.0, 0.0), (float(found[0]), float(found[1])), motion]
        changes = [shifted_change(earlier, later, guess) for guess in guesses]
        best = int(np.argmin(changes))
        return changes[best], guesses[best]


def find_cuts(frames: Iterable[np.ndarray]) -> tuple[int, ...]:
    """Positions of the frames (RGB uint8, in order) that start a new shot; the first frame never does."""
    return tuple(_cuts(detection_frame(frame) for frame in frames))


def _cuts(frames: Iterator[np.ndarray]) -> Iterator[int]:
    """The cuts among Lab frames, each decided once `LAG` more frames are in, holding only `LAG + 2` frames."""
    held: deque[np.ndarray] = deque(maxlen=LAG + 2)  # frames t - 1 to t + LAG of the frame t being decided
    changes: list[float] = [0.0]
    shifts: list[Shift] = [(0.0, 0.0)]
    comparer: _Comparer | None = None
    quiet_until = 0  # frames up to here are inside a flash
    count = 0
    for count, frame in enumerate(frames, start=1):
        if comparer is None:
            comparer = _Comparer(frame.shape)
        if held:
            change, shift = comparer.change(held[-1], frame, shifts[-1])
            if len(held) >= 2:
                # The pan this pair shows may be the one phase correlation missed in the pair before.
                changes[-1] = min(changes[-1], shifted_change(held[-2], held[-1], shift))
            changes.append(change)
            shifts.append(shift)
        held.append(frame)
        if count - 1 - LAG >= 1:
            cut, quiet_until = _decide(count - 1 - LAG, changes, shifts, list(held), comparer, quiet_until)
            if cut:
                yield count - 1 - LAG
    if comparer is None:  # no frames
        return
    # The last frames, with fewer after them.
    first_held = count - len(held)
    for t in range(max(1, count - LAG), count):
        cut, quiet_until = _decide(t, changes, shifts, list(held)[t - 1 - first_held :], comparer, quiet_until)
        if cut:
            yield t


def _decide(
    t: int, changes: list[float], shifts: list[Shift], frames: list[np.ndarray], comparer: _Comparer, quiet_until: int
) -> tuple[bool, int]:
    """Whether frame `t` starts a shot (`frames` are those from t - 1 on), and the last frame of the flash it is in."""
    if t <= quiet_until:
        return False, quiet_until
    change = changes[t]
    near = [changes[j] for j in range(max(1, t - NEIGHBOURS), min(len(changes), t + NEIGHBOURS + 1)) if j != t]
    baseline = float(np.median(near)) if near else 0.0
    if change < CUT_FLOOR or change < CUT_RATIO * baseline:
        return False, quiet_until
    before, motion = frames[0], shifts[t - 1]
    for k in range(1, min(FLASH_FRAMES, len(frames) - 2) + 1):
        back, _ = comparer.change(before, frames[1 + k], (motion[0] * (k + 1), motion[1] * (k + 1)))
        if back < min(CUT_FLOOR, change / 3):
            return False, t + k
    return True, quiet_until


def source_cuts(path: str | Path, indices: list[int]) -> tuple[int, ...]:
    """The cuts between the kept source frames `indices`, as positions among them (a kept frame that starts a
    shot)."""
    return find_cuts(media.iter_frames(path, indices, DETECT_WIDTH))
