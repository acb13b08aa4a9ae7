"""Scene cuts: where a source's shots change, so that no window mixes two shots (`k6vsr_core.windows`).

Detected on the CPU from the decoded frames with PySceneDetect's content detector: it scores each frame by its mean
change from the one before in hue, saturation and luma, and calls a cut where the score passes a threshold, at most
one cut in any `MIN_SHOT_FRAMES`, so that a flash or a fast pan does not cut a shot to pieces. It is the maintained
library most video tools use for this, it needs only OpenCV, and it looks at frames the way the windows need (a
hard cut between two frames), not at the container's key frames, which encoders place at will.

The detector reads the kept frames (those the output holds, after the 24-fps rule), scaled down to at most
`DETECT_WIDTH` pixels wide, as PySceneDetect's own command does: the score is a mean over the frame, so detail above
that width changes it little, and decoding stays a small part of a run.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from k6vsr_core import media

# PySceneDetect's defaults: its threshold (a change of 27 on a 0-255 scale), and a shortest shot of 15 frames.
CUT_THRESHOLD = 27.0
MIN_SHOT_FRAMES = 15
DETECT_WIDTH = 256


def find_cuts(frames: Iterable[np.ndarray], threshold: float = CUT_THRESHOLD) -> tuple[int, ...]:
    """Positions of the frames (RGB uint8, in order) that start a new shot; the first frame never does."""
    from scenedetect import ContentDetector, FrameTimecode

    detector = ContentDetector(threshold=threshold, min_scene_len=MIN_SHOT_FRAMES)
    cuts: list[int] = []
    position = 0
    for position, frame in enumerate(frames):
        # The detector's frames are OpenCV's BGR; its rate only turns positions into times, which are not used.
        found = detector.process_frame(
            FrameTimecode(timecode=position, fps=float(media.TARGET_FPS)), np.ascontiguousarray(frame[..., ::-1])
        )
        cuts.extend(cut.frame_num for cut in found)
    return tuple(sorted({cut for cut in cuts if 0 < cut <= position}))


def source_cuts(path: str | Path, indices: list[int], threshold: float = CUT_THRESHOLD) -> tuple[int, ...]:
    """The cuts between the kept source frames `indices`, as positions among them (a kept frame that starts a
    shot)."""
    return find_cuts(media.iter_frames(path, indices, DETECT_WIDTH), threshold)
