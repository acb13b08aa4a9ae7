"""Decoding a source's frames as RGB: every frame scanned once for its timestamps, then the frames a window needs."""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Literal

import av
import av.container
import numpy as np

from k6vsr_core.errors import MediaError
from k6vsr_core.media.fields import FieldOrder, deinterlaced
from k6vsr_core.media.probing import PathLike, open_input, video_stream

# RGB bits a channel: 8 (`rgb24`, what the model path takes) or 16 (`rgb48le`: a 10-bit source's code values
# scaled to 16 bits, never through 8).
Depth = Literal[8, 16]
_RGB_FORMATS = {8: "rgb24", 16: "rgb48le"}


def eight_bits(frames: np.ndarray) -> np.ndarray:
    """Frames as 8-bit RGB, for what only shows them (a preview, a still): uint16 ones rounded to the nearest of
    the 256 levels (v / 257), uint8 ones as they are."""
    if frames.dtype == np.uint8:
        return frames
    return np.rint(frames / 257.0).astype(np.uint8)


def _decode_indices(
    path: str, wanted: list[int], fields: FieldOrder | None = None, depth: Depth = 8
) -> tuple[dict[int, np.ndarray], int]:
    """Decode frames up to ``max(wanted)``, keeping only the wanted ones as RGB.

    Returns the kept frames by source index and how many frames were decoded,
    which is the stream's true length when decoding ran out early.
    """
    wanted_set = set(wanted)
    last = max(wanted)
    kept: dict[int, np.ndarray] = {}
    decoded = 0
    with open_input(path) as container:
        stream = video_stream(container, path)
        stream.thread_type = "AUTO"
        try:
            for index, frame in deinterlaced(enumerate(container.decode(stream)), fields):
                decoded = index + 1
                if index in wanted_set:
                    # rgb24 conversion copes with any source pix_fmt: 10-bit,
                    # alpha (dropped), paletted, full or limited range.
                    kept[index] = frame.to_ndarray(format=_RGB_FORMATS[depth])
                if index >= last:
                    break
        except av.error.FFmpegError as exc:
            raise MediaError(path, f"decoding failed after {decoded} frame(s) ({exc})") from exc
    return kept, decoded


def _stack_frames(path: str, indices: list[int], kept: dict[int, np.ndarray]) -> np.ndarray:
    height, width = kept[indices[0]].shape[:2]
    out = np.empty((len(indices), height, width, 3), dtype=kept[indices[0]].dtype)
    # A frame kept twice (a variable rate resampled on its timestamps repeats frames) is dropped after its last use.
    last_use = {index: position for position, index in enumerate(indices)}
    for position, index in enumerate(indices):
        # Popping as we copy keeps peak memory near one clip instead of two.
        frame = kept.pop(index) if last_use[index] == position else kept[index]
        if frame.shape[:2] != (height, width):
            raise MediaError(
                path,
                f"frame {index} is {frame.shape[1]}x{frame.shape[0]} but frame {indices[0]} is "
                f"{width}x{height}; resolution changes mid-stream are not supported",
            )
        out[position] = frame
    return out


def scan_frames(path: PathLike) -> tuple[int, np.ndarray | None]:
    """Decode every frame once (no colour conversion): how many there are, and their timestamps in order.

    The count is the stream's true length, whatever the header says; the timestamps let :func:`read_frames` seek
    straight to a window. They are ``None`` when the frames carry no usable ones (missing or not increasing):
    windows are then read by decoding from the start.
    """
    path = os.fspath(path)
    stamps: list[int] = []
    usable = True
    with open_input(path) as container:
        stream = video_stream(container, path)
        stream.thread_type = "AUTO"
        try:
            for frame in container.decode(stream):
                if frame.pts is None:
                    usable = False
                stamps.append(-1 if frame.pts is None else int(frame.pts))
        except av.error.FFmpegError as exc:
            if not stamps:
                raise MediaError(path, f"decoding failed ({exc})") from exc
            # A damaged tail: the frames before it are the video.
            warnings.warn(f"{path}: decoding stopped after {len(stamps)} frame(s) ({exc})", stacklevel=2)
    if not stamps:
        raise MediaError(path, "video stream has no decodable frames")
    pts = np.asarray(stamps, dtype=np.int64)
    if not usable or np.any(np.diff(pts) <= 0):
        return len(stamps), None
    return len(stamps), pts


def read_frames(
    path: PathLike,
    indices: list[int],
    frame_pts: np.ndarray | None = None,
    fields: FieldOrder | None = None,
    depth: Depth = 8,
) -> np.ndarray:
    """Decode the source frames at ``indices`` (ascending; a repeated one is given again) as ``(T, H, W, 3)`` RGB:
    uint8, or uint16 with ``depth=16`` (for 10-bit sources), each with the source's own matrix and range,
    deinterlaced with ``fields`` first (the plan's field order, `k6vsr_core.media.fields`).

    With the timestamps of :func:`scan_frames`, decoding starts at the key frame before the first wanted frame (the
    one before that, deinterlacing: each frame is made with its neighbours); without them, at the start of the stream.
    """
    path = os.fspath(path)
    if not indices:
        raise ValueError("no frames asked for")
    if frame_pts is not None and indices[-1] < len(frame_pts):
        kept = _decode_by_pts(path, indices, frame_pts, fields, depth)
        if kept is not None:
            return _stack_frames(path, indices, kept)
    kept, decoded = _decode_indices(path, indices, fields, depth)
    if len(kept) < len(set(indices)):
        raise MediaError(path, f"only {decoded} frame(s) could be decoded, frame {indices[-1]} was asked for")
    return _stack_frames(path, indices, kept)


def _decode_by_pts(
    path: str, indices: list[int], frame_pts: np.ndarray, fields: FieldOrder | None, depth: Depth = 8
) -> dict[int, np.ndarray] | None:
    """Frames at ``indices`` found by timestamp after one seek; None when the stream does not match the scan."""
    wanted = {int(frame_pts[index]): index for index in indices}
    last = int(frame_pts[indices[-1]])
    # A deinterlaced frame is made with the one before it: decoding starts no later than that one.
    start = int(frame_pts[max(0, indices[0] - 1)] if fields is not None else frame_pts[indices[0]])
    kept: dict[int, np.ndarray] = {}
    with open_input(path) as container:
        stream = video_stream(container, path)
        stream.thread_type = "AUTO"
        try:
            container.seek(start, stream=stream, backward=True, any_frame=False)
            for pts, frame in deinterlaced(((frame.pts, frame) for frame in container.decode(stream)), fields):
                if pts is None:
                    return None
                index = wanted.get(int(pts))
                if index is not None:
                    kept[index] = frame.to_ndarray(format=_RGB_FORMATS[depth])
                if pts >= last:
                    break
        except av.error.FFmpegError:
            return None
    return kept if len(kept) == len(set(indices)) else None


def iter_frames(
    path: PathLike, indices: list[int], max_width: int | None = None, fields: FieldOrder | None = None
) -> Iterator[np.ndarray]:
    """The source frames at ``indices`` (ascending) as RGB (deinterlaced with ``fields``, as :func:`read_frames`),
    one at a time, decoding the stream once from the start:
    a whole video read this way holds one frame. A stream shorter than its header says, or with a damaged tail, ends
    the frames early (as `scan_frames` counts them). With ``max_width``, wider frames are scaled down to it (aspect
    kept, even height), for analyses that need no full-size frame."""
    path = os.fspath(path)
    if not indices:
        return
    wanted = Counter(indices)  # a frame kept twice is yielded twice
    last = indices[-1]
    index = -1
    with open_input(path) as container:
        stream = video_stream(container, path)
        stream.thread_type = "AUTO"
        try:
            for index, frame in deinterlaced(enumerate(container.decode(stream)), fields):
                if index in wanted:
                    if max_width is not None and frame.width > max_width:
                        height = max(2, round(frame.height * max_width / frame.width / 2) * 2)
                        image = frame.to_ndarray(format="rgb24", width=max_width, height=height)
                    else:
                        image = frame.to_ndarray(format="rgb24")
                    for _ in range(wanted[index]):
                        yield image
                if index >= last:
                    return
        except av.error.FFmpegError as exc:
            if index < 0:
                raise MediaError(path, f"decoding failed ({exc})") from exc
