"""Video and audio file I/O for the super-resolution pipeline.

The model works on a fixed clip shape: at most 121 frames, a frame count of the
form ``1 + 8k`` and a frame rate close to 24 fps.  Real inputs come at any rate,
length, size and pixel format, sometimes with lying or missing metadata.  This
module is the single place that turns such files into RGB arrays the model can
take, and turns upscaled arrays (plus the source's audio) back into a playable,
reproducible H.264/AAC MP4.  Everything here is a pure function over PyAV so it
can be tested without the orchestration or storage layers.
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
import warnings
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import av
import av.container
import numpy as np
from av.video.reformatter import ColorRange, Colorspace
from pydantic import BaseModel, ConfigDict

from k6vsr_core.encoding import VideoEncoding
from k6vsr_core.errors import MediaError

__all__ = [
    "AUDIO_SAMPLE_RATE",
    "MAX_NUM_FRAMES",
    "MAX_SOURCE_PIXELS",
    "MAX_SOURCE_SIDE",
    "RESAMPLE_FPS_TOLERANCE",
    "TARGET_FPS",
    "MediaError",
    "VideoProbe",
    "aligned_frame_count",
    "decode_audio",
    "decode_frames",
    "probe",
    "select_all_frames",
    "select_frames",
    "trim_audio",
    "write_video",
]

TARGET_FPS = 24
MAX_NUM_FRAMES = 121
RESAMPLE_FPS_TOLERANCE = 1.5
AUDIO_SAMPLE_RATE = 44100

# Anything above this is broken timing metadata (e.g. a 1/90000 tick taken as a
# frame rate), not a real capture rate.
_MAX_SOURCE_FPS = 1000.0
# Larger frames are refused before anything is decoded: one decoded frame of a file that declares, say,
# 60000x60000 would take gigabytes, and no delivery tier or model output is anywhere near that size (8K is 33 MP).
MAX_SOURCE_SIDE = 8192
MAX_SOURCE_PIXELS = 40_000_000
# The model only accepts clips of 1 + 8k frames.
_FRAME_GROUP = 8
_AUDIO_CODEC = "aac"
_AUDIO_BIT_RATE = 192_000
# FFmpeg's BT.709 code is 1 for the colorspace, primaries and transfer enums alike.
_BT709 = 1

PathLike = str | os.PathLike[str]
# The contract's rates are whole numbers; `--fps source` keeps the source's exact rational rate (30000/1001).
FrameRate = int | Fraction
_CONTRACT = VideoEncoding()
HEVC_MIN_SIDE = 128


class VideoProbe(BaseModel):
    """What the pipeline needs to know about a source video before decoding it.

    ``width``, ``height`` and ``pix_fmt`` describe the first decoded frame, i.e.
    what :func:`decode_frames` will return.  ``rotation`` is the display-matrix
    angle in degrees counter-clockwise (PyAV's convention, range -180..180), 0
    when the file carries none; decoded frames are *not* rotated.
    """

    model_config = ConfigDict(frozen=True)

    path: str
    width: int
    height: int
    num_frames: int
    fps: float
    has_audio: bool
    codec: str
    pix_fmt: str
    rotation: int
    duration_s: float | None
    rate: str | None = None  # the exact rate as a fraction ("30000/1001"), for `--fps source`


# --------------------------------------------------------------------------- #
# Frame selection
# --------------------------------------------------------------------------- #


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


# --------------------------------------------------------------------------- #
# Reading
# --------------------------------------------------------------------------- #


def _open_input(path: str) -> av.container.InputContainer:
    # The filesystem checks come first so the error says what is actually
    # wrong; FFmpeg reports an empty file as "invalid data", for instance.
    if not os.path.lexists(path):
        raise MediaError(path, "no such file")
    if not os.path.exists(path):
        raise MediaError(path, "no such file (broken symbolic link)")
    if os.path.isdir(path):
        raise MediaError(path, "is a directory, not a media file")
    if not os.path.isfile(path):
        # A FIFO would block the open (and the checksum) forever, a device would be read without end.
        raise MediaError(path, f"is not a regular file ({_file_kind(path)}); give a video file")
    if not os.access(path, os.R_OK):
        raise MediaError(path, "permission denied: file is not readable")
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise MediaError(path, "empty file (0 bytes)")
    try:
        return av.open(path, mode="r")
    except PermissionError as exc:
        raise MediaError(path, "permission denied: file is not readable") from exc
    except (av.error.FFmpegError, OSError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise MediaError(path, f"not a readable media file ({reason})") from exc


def _file_kind(path: str) -> str:
    mode = os.stat(path).st_mode
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a special file"


def _check_frame_size(path: str, width: int, height: int, what: str) -> None:
    if width <= 0 or height <= 0:
        return
    if max(width, height) > MAX_SOURCE_SIDE or width * height > MAX_SOURCE_PIXELS:
        raise MediaError(
            path,
            f"{what} resolution {width}x{height} is too large (at most {MAX_SOURCE_SIDE} pixels a side and "
            f"{MAX_SOURCE_PIXELS // 1_000_000} MP a frame)",
        )


def _video_stream(container: av.container.InputContainer, path: str) -> av.VideoStream:
    if not container.streams.video:
        kinds = sorted({stream.type for stream in container.streams})
        found = f" (found only: {', '.join(kinds)})" if kinds else ""
        raise MediaError(path, f"no video stream{found}")
    stream = container.streams.video[0]
    if stream.codec_context is None:
        # FFmpeg found a video track but no decoder parameters: a cut-off header or an unsupported codec.
        raise MediaError(path, "the video stream cannot be decoded (unknown codec, or a damaged or truncated header)")
    return stream


def _source_fps(stream: av.VideoStream, path: str) -> float:
    rate = stream.average_rate or stream.base_rate
    if rate is None:
        raise MediaError(path, "frame rate is unknown (the stream reports none)")
    fps = float(rate)
    if fps <= 0:
        raise MediaError(path, f"frame rate {fps:g} fps is not positive")
    if fps > _MAX_SOURCE_FPS:
        raise MediaError(
            path, f"frame rate {fps:g} fps is implausible (> {_MAX_SOURCE_FPS:g}); timing metadata is broken"
        )
    return fps


def _first_frame_and_packet_count(
    container: av.container.InputContainer, stream: av.VideoStream, path: str, count_packets: bool
) -> tuple[av.VideoFrame | None, int]:
    """Decode just the first frame; optionally count the stream's packets too.

    Counting demuxes without decoding, which is what makes it cheap enough to
    do for formats (Matroska, WebM, some MPEG-TS) that store no frame count.
    """
    first: av.VideoFrame | None = None
    packets = 0
    try:
        for packet in container.demux(stream):
            if packet.size:
                packets += 1
            # The empty packet PyAV yields at end of stream flushes the decoder,
            # so a stream whose only frame is held back by the decoder still counts.
            if first is None:
                decoded = packet.decode()
                if decoded:
                    first = decoded[0]
            if first is not None and not count_packets:
                break
    except av.error.FFmpegError as exc:
        raise MediaError(path, f"could not read the video stream ({exc})") from exc
    return first, packets


def _duration_s(container: av.container.InputContainer, stream: av.VideoStream) -> float | None:
    if stream.duration and stream.time_base:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration:
        seconds = container.duration / av.time_base
    else:
        return None
    return seconds if seconds > 0 else None


def _probe_file(path: str) -> VideoProbe:
    with _open_input(path) as container:
        stream = _video_stream(container, path)
        # The header's size, checked before the first frame is decoded (which is what could exhaust memory).
        _check_frame_size(path, stream.codec_context.width, stream.codec_context.height, "declared")
        fps = _source_fps(stream, path)
        reported = stream.frames if stream.frames and stream.frames > 0 else 0
        first, packets = _first_frame_and_packet_count(container, stream, path, count_packets=not reported)
        if first is None:
            raise MediaError(path, "video stream has no decodable frames")
        _check_frame_size(path, first.width, first.height, "decoded")
        return VideoProbe(
            path=path,
            width=first.width,
            height=first.height,
            num_frames=reported or max(packets, 1),
            fps=fps,
            has_audio=bool(container.streams.audio),
            codec=stream.codec_context.name,
            pix_fmt=first.format.name,
            rotation=int(first.rotation),
            duration_s=_duration_s(container, stream),
            rate=str(Fraction(stream.average_rate or stream.base_rate)),
        )


def probe(path: PathLike) -> VideoProbe:
    """Describe the first video stream of ``path``, or raise :class:`MediaError`.

    ``num_frames`` is the container's frame count when it has one, otherwise
    the number of video packets; either may be wrong for damaged or
    variable-rate files, which :func:`decode_frames` tolerates.
    """
    return _probe_file(os.fspath(path))


def _decode_indices(path: str, wanted: list[int]) -> tuple[dict[int, np.ndarray], int]:
    """Decode frames up to ``max(wanted)``, keeping only the wanted ones as RGB.

    Returns the kept frames by source index and how many frames were decoded,
    which is the stream's true length when decoding ran out early.
    """
    wanted_set = set(wanted)
    last = max(wanted)
    kept: dict[int, np.ndarray] = {}
    decoded = 0
    with _open_input(path) as container:
        stream = _video_stream(container, path)
        stream.thread_type = "AUTO"
        try:
            for index, frame in enumerate(container.decode(stream)):
                decoded = index + 1
                if index in wanted_set:
                    # rgb24 conversion copes with any source pix_fmt: 10-bit,
                    # alpha (dropped), paletted, full or limited range.
                    kept[index] = frame.to_ndarray(format="rgb24")
                if index >= last:
                    break
        except av.error.FFmpegError as exc:
            raise MediaError(path, f"decoding failed after {decoded} frame(s) ({exc})") from exc
    return kept, decoded


def _stack_frames(path: str, indices: list[int], kept: dict[int, np.ndarray]) -> np.ndarray:
    height, width = kept[indices[0]].shape[:2]
    out = np.empty((len(indices), height, width, 3), dtype=np.uint8)
    for position, index in enumerate(indices):
        # Popping as we copy keeps peak memory near one clip instead of two.
        frame = kept.pop(index)
        if frame.shape[:2] != (height, width):
            raise MediaError(
                path,
                f"frame {index} is {frame.shape[1]}x{frame.shape[0]} but frame {indices[0]} is "
                f"{width}x{height}; resolution changes mid-stream are not supported",
            )
        out[position] = frame
    return out


def decode_frames(path: PathLike, probe: VideoProbe | None = None) -> tuple[np.ndarray, int]:
    """Decode the frames :func:`select_frames` keeps, as RGB.

    Returns a ``(T, H, W, 3)`` uint8 array and the effective frame rate.
    Decoding stops right after the last kept frame.  If the stream turns out
    shorter than the probe said, the selection is recomputed on the real count
    instead of failing, as long as at least one frame survives.
    """
    path = os.fspath(path)
    info = probe if probe is not None else _probe_file(path)
    try:
        indices, fps = select_frames(info.num_frames, info.fps)
    except ValueError as exc:
        raise MediaError(path, str(exc)) from exc

    kept, decoded = _decode_indices(path, indices)
    if len(kept) < len(indices):
        # The stream ended early. No second pass is needed: a smaller count
        # selects a prefix of the same index sequence, all below the decoded
        # count, so those frames are already kept.
        try:
            indices, fps = select_frames(decoded, info.fps)
        except ValueError as exc:
            raise MediaError(
                path, f"only {decoded} of {info.num_frames} expected frame(s) could be decoded: {exc}"
            ) from exc
        # Not an error (the frames that exist are used), but never silent: the output is shorter than the file said.
        warnings.warn(
            f"{path}: only {decoded} of {info.num_frames} frame(s) could be decoded (truncated or damaged file?); "
            f"using {len(indices)}",
            stacklevel=2,
        )
    return _stack_frames(path, indices, kept), fps


def scan_frames(path: PathLike) -> tuple[int, np.ndarray | None]:
    """Decode every frame once (no colour conversion): how many there are, and their timestamps in order.

    The count is the stream's true length, whatever the header says; the timestamps let :func:`read_frames` seek
    straight to a window. They are ``None`` when the frames carry no usable ones (missing or not increasing):
    windows are then read by decoding from the start.
    """
    path = os.fspath(path)
    stamps: list[int] = []
    usable = True
    with _open_input(path) as container:
        stream = _video_stream(container, path)
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


def read_frames(path: PathLike, indices: list[int], frame_pts: np.ndarray | None = None) -> np.ndarray:
    """Decode the source frames at ``indices`` (ascending) as ``(T, H, W, 3)`` RGB.

    With the timestamps of :func:`scan_frames`, decoding starts at the key frame before the first wanted frame;
    without them, at the start of the stream.
    """
    path = os.fspath(path)
    if not indices:
        raise ValueError("no frames asked for")
    if frame_pts is not None and indices[-1] < len(frame_pts):
        kept = _decode_by_pts(path, indices, frame_pts)
        if kept is not None:
            return _stack_frames(path, indices, kept)
    kept, decoded = _decode_indices(path, indices)
    if len(kept) < len(indices):
        raise MediaError(path, f"only {decoded} frame(s) could be decoded, frame {indices[-1]} was asked for")
    return _stack_frames(path, indices, kept)


def _decode_by_pts(path: str, indices: list[int], frame_pts: np.ndarray) -> dict[int, np.ndarray] | None:
    """Frames at ``indices`` found by timestamp after one seek; None when the stream does not match the scan."""
    wanted = {int(frame_pts[index]): index for index in indices}
    last = int(frame_pts[indices[-1]])
    kept: dict[int, np.ndarray] = {}
    with _open_input(path) as container:
        stream = _video_stream(container, path)
        stream.thread_type = "AUTO"
        try:
            container.seek(int(frame_pts[indices[0]]), stream=stream, backward=True, any_frame=False)
            for frame in container.decode(stream):
                if frame.pts is None:
                    return None
                index = wanted.get(int(frame.pts))
                if index is not None:
                    kept[index] = frame.to_ndarray(format="rgb24")
                if frame.pts >= last:
                    break
        except av.error.FFmpegError:
            return None
    return kept if len(kept) == len(indices) else None


def _audio_chunks(path: str) -> Iterator[np.ndarray]:
    """The first audio stream as mono float32 pieces at ``AUDIO_SAMPLE_RATE``, clipped to [-1, 1]."""
    with _open_input(path) as container:
        if not container.streams.audio:
            return
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="fltp", layout="mono", rate=AUDIO_SAMPLE_RATE)
        fed = False
        try:
            for frame in container.decode(stream):
                fed = True
                for out in resampler.resample(frame):
                    # Resampling and integer-to-float conversion can overshoot full scale slightly.
                    yield np.clip(out.to_ndarray()[0], -1.0, 1.0).astype(np.float32, copy=False)
            if fed:
                # The resampler holds back its filter delay until flushed.
                for out in resampler.resample(None):
                    yield np.clip(out.to_ndarray()[0], -1.0, 1.0).astype(np.float32, copy=False)
        except (av.error.FFmpegError, ValueError) as exc:
            raise MediaError(path, f"could not decode the audio stream ({exc})") from exc


def decode_audio(path: PathLike) -> np.ndarray | None:
    """Decode the first audio stream as mono float32 at ``AUDIO_SAMPLE_RATE``.

    Returns a 1-D array clipped to [-1, 1], or ``None`` when the file has no
    audio stream or the stream yields no samples.
    """
    chunks = list(_audio_chunks(os.fspath(path)))
    audio = np.concatenate(chunks).astype(np.float32, copy=False) if chunks else None
    return audio if audio is not None and audio.size else None


def check_audio_file(path: PathLike) -> None:
    """Refuse, naming it, a file given as the output's audio that holds no decodable audio stream."""
    path = os.fspath(path)
    with _open_input(path) as container:
        if not container.streams.audio:
            raise MediaError(path, "has no audio stream (given as --audio)")


def write_audio_track(path: PathLike, destination: PathLike, num_frames: int, fps: int | Fraction) -> int:
    """Stream the audio of ``path`` as raw mono float32 samples into ``destination``, cut to ``num_frames`` video
    frames at ``fps`` (as :func:`trim_audio`): memory stays one decoded packet whatever the length. Returns the
    number of samples written (0: no audio)."""
    limit = round(num_frames / fps * AUDIO_SAMPLE_RATE)
    written = 0
    with open(destination, "wb") as handle:
        for chunk in _audio_chunks(os.fspath(path)):
            piece = chunk[: limit - written]
            handle.write(piece.tobytes())
            written += piece.size
            if written >= limit:
                break
    return written


def trim_audio(audio: np.ndarray, num_frames: int, fps: int | Fraction) -> np.ndarray:
    """Cut mono audio to the length of ``num_frames`` video frames at ``fps``.

    Audio that is already shorter is returned as is: padding with silence or
    stretching would misrepresent the source.
    """
    if audio.ndim != 1:
        raise ValueError(f"audio must be a 1-D mono array, got shape {audio.shape}")
    if num_frames < 0:
        raise ValueError(f"num_frames must not be negative, got {num_frames}")
    if fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    return audio[: round(num_frames / fps * AUDIO_SAMPLE_RATE)]


# --------------------------------------------------------------------------- #
# Writing
# --------------------------------------------------------------------------- #


def _check_frames(frames: np.ndarray) -> None:
    if not isinstance(frames, np.ndarray):
        raise ValueError(f"frames must be a numpy array, got {type(frames).__name__}")
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must have shape (T, H, W, 3), got {frames.shape}")
    if frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 RGB, got dtype {frames.dtype}")
    if frames.shape[0] < 1 or frames.shape[1] < 1 or frames.shape[2] < 1:
        raise ValueError(f"frames must hold at least one non-empty frame, got shape {frames.shape}")


def _prepare_audio(audio: np.ndarray, num_frames: int, fps: int | Fraction) -> np.ndarray | None:
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim != 1:
        raise ValueError(f"audio must be a 1-D mono array at {AUDIO_SAMPLE_RATE} Hz, got shape {audio.shape}")
    audio = np.clip(trim_audio(audio, num_frames, fps), -1.0, 1.0)
    return audio if audio.size else None


def _encoder_frames(frames: np.ndarray, fps: FrameRate, encoding: VideoEncoding = _CONTRACT) -> Iterator[av.VideoFrame]:
    """Yield frames in the stream's pixel format (BT.709 for YUV), padded to even size for 4:2:0, pts = index."""
    pad = encoding.needs_even_size
    pad_h, pad_w = (frames.shape[1] % 2, frames.shape[2] % 2) if pad else (0, 0)
    time_base = 1 / Fraction(fps)
    for index, rgb in enumerate(frames):
        if pad_h or pad_w:
            rgb = np.pad(rgb, ((0, pad_h), (0, pad_w), (0, 0)), mode="edge")
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
        if encoding.is_rgb:
            frame = frame.reformat(format=encoding.stream_pix_fmt)
        else:
            # Convert explicitly so the matrix used matches the BT.709 tags on the
            # stream; left implicit, swscale would use BT.601 and tag nothing, and
            # players would guess (usually BT.709 for HD) and shift the colours.
            frame = frame.reformat(
                format=encoding.stream_pix_fmt, dst_colorspace=Colorspace.ITU709, dst_color_range=ColorRange.MPEG
            )
        frame.pts = index
        frame.time_base = time_base
        yield frame


def _add_video_stream(
    container: av.container.OutputContainer,
    width: int,
    height: int,
    fps: FrameRate,
    rotation: int,
    encoding: VideoEncoding = _CONTRACT,
) -> av.VideoStream:
    video = container.add_stream(encoding.encoder, rate=fps, options=encoding.options())
    if rotation:
        # Pixels stay as stored (the model never sees rotation); players turn them as they did the source.
        video.set_display_rotation(rotation)
    even = encoding.needs_even_size
    video.width = width + (width % 2 if even else 0)
    video.height = height + (height % 2 if even else 0)
    video.pix_fmt = encoding.stream_pix_fmt
    video.codec_context.time_base = 1 / Fraction(fps)
    if not encoding.is_rgb:
        video.codec_context.colorspace = _BT709
        video.codec_context.color_primaries = _BT709
        video.codec_context.color_trc = _BT709
        video.codec_context.color_range = ColorRange.MPEG
    if encoding.codec == "ffv1":
        # FFV1's slice layout follows the thread count: one thread keeps the bytes the same on every host.
        video.codec_context.thread_count = 1
    return video


def _mux(
    container: av.container.OutputContainer,
    frames: np.ndarray,
    fps: FrameRate,
    audio: np.ndarray | None,
    rotation: int,
    encoding: VideoEncoding = _CONTRACT,
) -> None:
    video = _add_video_stream(container, frames.shape[2], frames.shape[1], fps, rotation, encoding)

    sound = None
    if audio is not None:
        sound = container.add_stream(_AUDIO_CODEC, rate=AUDIO_SAMPLE_RATE, layout="mono")
        sound.bit_rate = _AUDIO_BIT_RATE

    for frame in _encoder_frames(frames, fps, encoding):
        container.mux(video.encode(frame))
    container.mux(video.encode(None))

    if sound is not None and audio is not None:
        samples = av.AudioFrame.from_ndarray(audio[np.newaxis, :], format="fltp", layout="mono")
        samples.sample_rate = AUDIO_SAMPLE_RATE
        samples.time_base = Fraction(1, AUDIO_SAMPLE_RATE)
        samples.pts = 0
        container.mux(sound.encode(samples))
        container.mux(sound.encode(None))


@contextlib.contextmanager
def _whole_or_removed(path: str, doing: str) -> Iterator[None]:
    """The file at `path` is whole when the block ends, or gone: a failed or interrupted write leaves no half file."""
    try:
        yield
    except Exception as exc:
        _remove_quietly(path)
        raise MediaError(path, f"could not {doing} ({exc})") from exc
    except BaseException:
        _remove_quietly(path)
        raise


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _check_rate(fps: object) -> FrameRate:
    if isinstance(fps, bool) or not isinstance(fps, (int, np.integer, Fraction)) or fps <= 0:
        raise ValueError(f"fps must be a positive integer or fraction, got {fps!r}")
    return fps if isinstance(fps, Fraction) and fps.denominator != 1 else int(fps)


def _open_output(path: str, encoding: VideoEncoding) -> av.container.OutputContainer:
    # bitexact drops the muxer's version tag (and Matroska's random ids); faststart puts the MP4 index first so
    # browsers can start playback before the whole file loads.
    options = {"fflags": "+bitexact"}
    if encoding.container == "mp4":
        options["movflags"] = "+faststart"
    return av.open(path, mode="w", format=encoding.container, options=options)


def write_video(
    path: PathLike,
    frames: np.ndarray,
    fps: FrameRate,
    audio: np.ndarray | None,
    rotation: int = 0,
    encoding: VideoEncoding | None = None,
) -> None:
    """Encode RGB frames (and optional mono audio) as a video file at ``path``.

    - ``frames``: ``(T, H, W, 3)`` uint8 RGB; frame ``i`` gets pts ``i`` in a
      ``1/fps`` time base.  By default video is libx264, yuv420p, CRF 18, tagged
      BT.709, in MP4 (the contract's file); ``encoding`` picks another codec,
      quality, preset or pixel format (FFV1 goes in Matroska).
    - Odd sizes: yuv420p needs even width and height, so an odd dimension is
      padded by repeating the last row/column (the output is then one pixel
      larger) rather than cropped, which would lose upscaled content, or
      rejected, which would fail a whole run over one pixel.
    - ``audio``: 1-D float at ``AUDIO_SAMPLE_RATE`` (as from
      :func:`decode_audio`), trimmed with :func:`trim_audio` and encoded as AAC
      mono 192 kb/s.  ``None``, or audio that trims to nothing, gives a
      video-only file.
    - ``rotation``: the source's display rotation (degrees, as :func:`probe`
      reports it), written as the stream's display matrix.
    - The container follows ``encoding``, whatever the file name, so callers can
      write to a temporary name and rename it.  The output is byte-identical for
      identical inputs (no timestamps or library versions are embedded).
    - The file is written in place; if encoding fails it is removed and a
      :class:`MediaError` naming ``path`` is raised.
    """
    _check_frames(frames)
    fps = _check_rate(fps)
    encoding = encoding or _CONTRACT
    if encoding.codec == "hevc" and min(frames.shape[1:3]) < HEVC_MIN_SIDE:
        # x265 gives run-to-run different output below this, and corrupts its heap on smaller frames still.
        raise ValueError(f"codec=hevc needs frames of at least {HEVC_MIN_SIDE} pixels a side, got {frames.shape[1:3]}")
    if audio is not None:
        audio = _prepare_audio(audio, frames.shape[0], fps)

    path = os.fspath(path)
    with _whole_or_removed(path, "write video"), _open_output(path, encoding) as container:
        _mux(container, frames, fps, audio, int(rotation), encoding)


def write_segment(path: PathLike, frames: np.ndarray, fps: FrameRate, encoding: VideoEncoding | None = None) -> None:
    """One window's frames as a video-only file that starts on a key frame, for :func:`concat_segments`."""
    write_video(path, frames, fps, None, encoding=encoding)


def concat_segments(
    segments: list[str],
    path: PathLike,
    fps: FrameRate,
    audio: np.ndarray | None,
    num_frames: int,
    rotation: int = 0,
    encoding: VideoEncoding | None = None,
    original: str | None = None,
) -> None:
    """Join video-only segments by stream copy and add the audio, as :func:`write_video` would have written them.

    Each segment's packets are copied, shifted by the frames before it; the audio (1-D float at
    ``AUDIO_SAMPLE_RATE``, e.g. a memory map: it is read a segment's span at a time) is trimmed to ``num_frames``
    and encoded as :func:`write_video` does, interleaved segment by segment. Nothing is decoded or re-encoded, so
    memory stays one segment's packets, whatever the length. On failure the file is removed.

    ``original``: a source file whose every audio and subtitle stream (and container metadata) is carried over
    instead, trimmed to the output's span (:class:`SourceStreams`); ``audio`` is then ignored.
    """
    if not segments:
        raise ValueError("no segments to join")
    path = os.fspath(path)
    fps = _check_rate(fps)
    encoding = encoding or _CONTRACT
    limit = round(num_frames / fps * AUDIO_SAMPLE_RATE)
    frame_base = 1 / Fraction(fps)
    with _whole_or_removed(path, "join the segments"):
        with _open_output(path, encoding) as out:
            with av.open(segments[0]) as first:
                video = out.add_stream_from_template(first.streams.video[0])
            video.codec_context.bit_rate = 0
            if rotation:
                video.set_display_rotation(int(rotation))
            sound = None
            if original is None and audio is not None and min(limit, len(audio)) > 0:
                sound = out.add_stream(_AUDIO_CODEC, rate=AUDIO_SAMPLE_RATE, layout="mono")
                sound.bit_rate = _AUDIO_BIT_RATE
            carried = SourceStreams(original, out, num_frames * frame_base) if original is not None else None
            offset = 0
            sent = 0
            for segment in segments:
                offset += _copy_segment(out, video, segment, offset, frame_base)
                if sound is not None and audio is not None:
                    upto = min(limit, len(audio), round(offset / fps * AUDIO_SAMPLE_RATE))
                    sent = _encode_audio(out, sound, audio, sent, upto)
                if carried is not None:
                    carried.feed(offset * frame_base)
            if sound is not None:
                out.mux(sound.encode(None))
            if carried is not None:
                carried.finish()
    if offset != num_frames:
        _remove_quietly(path)
        raise MediaError(path, f"the segments hold {offset} frames, expected {num_frames}")


def _copy_segment(
    out: av.container.OutputContainer, video: av.VideoStream, segment: str, offset: int, frame_base: Fraction
) -> int:
    """Mux one segment's packets, shifted by `offset` frames; returns its frame count."""
    frames = 0
    with av.open(segment) as source:
        stream = source.streams.video[0]
        for packet in source.demux(stream):
            if packet.size == 0 or packet.pts is None or packet.dts is None:
                continue
            # In frames: each segment starts at 0 (its B-frame delay makes the first dts negative).
            packet.pts = round(packet.pts * stream.time_base / frame_base) + offset
            packet.dts = round(packet.dts * stream.time_base / frame_base) + offset
            packet.duration = 1
            packet.time_base = frame_base
            packet.stream = video
            out.mux(packet)
            frames += 1
    return frames


def _encode_audio(
    out: av.container.OutputContainer, sound: av.AudioStream, audio: np.ndarray, start: int, stop: int
) -> int:
    if stop <= start:
        return start
    samples = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(audio[start:stop], dtype=np.float32)[np.newaxis, :], format="fltp", layout="mono"
    )
    samples.sample_rate = AUDIO_SAMPLE_RATE
    samples.time_base = Fraction(1, AUDIO_SAMPLE_RATE)
    samples.pts = start
    out.mux(sound.encode(samples))
    return stop


# --------------------------------------------------------------------------- #
# The source's own streams (`--audio original`)
# --------------------------------------------------------------------------- #

# Codecs each container takes by stream copy; any other audio is re-encoded as AAC at the source's layout and rate.
_COPY_AUDIO = {
    "mp4": {"aac", "mp3", "ac3", "eac3", "alac", "flac", "opus"},
    "matroska": {"aac", "mp3", "ac3", "eac3", "alac", "flac", "opus", "vorbis", "pcm_s16le", "pcm_s24le", "pcm_f32le"},
}
_COPY_SUBTITLES = {"mp4": {"mov_text"}, "matroska": {"subrip", "srt", "ass", "ssa", "webvtt", "hdmv_pgs_subtitle"}}
# Text subtitles a container cannot hold as they are are converted to the text format it takes: MP4 holds only
# mov_text (3GPP timed text), and Matroska takes ASS, which keeps what mov_text styles.
_TEXT_SUBTITLES = {"subrip", "srt", "ass", "ssa", "webvtt", "mov_text", "text", "microdvd", "subviewer", "jacosub"}
_CONVERT_SUBTITLES = {"mp4": "mov_text", "matroska": "ass"}
# Container metadata worth keeping; encoder tags and the like describe the old file, not the new one.
_KEPT_METADATA = ("title", "language", "creation_time", "comment", "description", "artist", "date", "copyright")


class SourceStreams:
    """Every audio and subtitle stream of a source, carried into an output being written, trimmed to `span`.

    Timestamps are taken relative to the source's first video frame, so what played together still does. Audio is
    copied packet by packet where the container takes the codec (the last packet may run past the end by less
    than one packet, ~21 ms for AAC) and otherwise decoded and re-encoded at the source's layout and rate, cut to
    the sample. Each stream's language tag goes with it; the container's title, creation time (and the like) too.
    """

    def __init__(self, source: str, out: av.container.OutputContainer, span: Fraction) -> None:
        self._input = _open_input(source)
        self._span = span
        self._done = False
        container_format = out.format.name.split(",")[0]
        copyable = _COPY_AUDIO.get(container_format, set())
        subtitles = _COPY_SUBTITLES.get(container_format, set())
        for key, value in self._input.metadata.items():
            if key.lower() in _KEPT_METADATA:
                out.metadata[key] = value
        video = self._input.streams.video[0] if self._input.streams.video else None
        start = video.start_time if video is not None and video.start_time is not None else 0
        self._origin = Fraction(start) * (video.time_base if video is not None else 1)
        self._out = out
        self._plans: dict[int, tuple[str, Any]] = {}  # input stream index -> (how, output stream or re-encoder)
        for stream in self._input.streams:
            name = stream.codec_context.name if stream.codec_context is not None else ""
            if stream.type == "audio" and name in copyable:
                target = out.add_stream_from_template(stream)
                self._plans[stream.index] = ("copy", target)
            elif stream.type == "audio":
                layout = stream.codec_context.layout.name
                target = out.add_stream(_AUDIO_CODEC, rate=stream.codec_context.sample_rate, layout=layout)
                target.bit_rate = _AUDIO_BIT_RATE * max(1, stream.codec_context.channels)
                self._plans[stream.index] = ("encode", _Reencoder(stream, target, self._origin, span))
            elif stream.type == "subtitle" and name in subtitles:
                self._plans[stream.index] = ("copy", out.add_stream_from_template(stream))
            elif stream.type == "subtitle" and name in _TEXT_SUBTITLES and container_format in _CONVERT_SUBTITLES:
                converter = _SubtitleConverter(stream, out, _CONVERT_SUBTITLES[container_format], self._origin, span)
                self._plans[stream.index] = ("encode", converter)
            else:
                if stream.type == "subtitle":
                    warnings.warn(
                        f"{source}: subtitle stream {stream.index} ({name}) is a picture format that "
                        f"{container_format} cannot hold; it is left out (Matroska keeps it: --codec ffv1)",
                        stacklevel=3,
                    )
                continue
            language = stream.metadata.get("language")
            if language:
                self._output_stream(stream.index).metadata["language"] = language
        wanted = [s for s in self._input.streams if s.index in self._plans]
        self._packets = self._input.demux(wanted) if wanted else iter(())
        self._pending: av.Packet | None = None

    def _output_stream(self, index: int) -> Any:
        how, target = self._plans[index]
        return target if how == "copy" else target.stream

    def feed(self, until: Fraction) -> None:
        """Carry every packet that starts before `until` (seconds of the output)."""
        while True:
            packet = self._pending or next(self._packets, None)
            self._pending = None
            if packet is None:
                return
            if packet.pts is None or packet.size == 0:
                continue
            start = Fraction(packet.pts) * packet.time_base - self._origin
            if start >= until:
                self._pending = packet
                return
            if start >= self._span:
                continue  # past the output's end: dropped
            how, target = self._plans[packet.stream.index]
            if how == "copy":
                shift = round(self._origin / packet.time_base)
                packet.pts -= shift
                if packet.dts is not None:
                    packet.dts -= shift
                packet.stream = target
                self._out.mux(packet)
            else:
                target.feed(packet, self._out)

    def finish(self) -> None:
        self.feed(self._span)
        for how, target in self._plans.values():
            if how == "encode":
                target.flush(self._out)
        self._input.close()


class _SubtitleConverter:
    """One text subtitle stream decoded and encoded in the text format the output's container takes, each cue at
    its source time (relative to the first video frame) and cut to the output's span."""

    def __init__(
        self, source: av.SubtitleStream, out: av.container.OutputContainer, codec: str, origin: Fraction, span: Fraction
    ) -> None:
        self._source = source
        self._origin, self._span = origin, span
        decoder = source.codec_context
        decoder.open()  # a text decoder makes the ASS header the encoder needs when it opens
        self.stream = out.add_stream(codec)
        self.stream.codec_context.subtitle_header = decoder.subtitle_header or _DEFAULT_ASS_HEADER
        self.stream.codec_context.time_base = _SUBTITLE_TIME_BASE

    def feed(self, packet: av.Packet, out: av.container.OutputContainer) -> None:
        cues = self._source.codec_context.decode2(packet)
        if cues is None or packet.pts is None:
            return
        start = Fraction(packet.pts) * packet.time_base - self._origin
        end = start + Fraction(packet.duration or 0) * packet.time_base
        start, end = max(start, Fraction(0)), min(end, self._span)
        if end <= start:
            return
        encoded = self.stream.codec_context.encode_subtitle(cues)
        encoded.stream, encoded.time_base = self.stream, _SUBTITLE_TIME_BASE
        encoded.pts = encoded.dts = round(start / _SUBTITLE_TIME_BASE)
        encoded.duration = round(end / _SUBTITLE_TIME_BASE) - encoded.pts
        out.mux(encoded)

    def flush(self, out: av.container.OutputContainer) -> None:
        """Every cue went out as it came."""


_SUBTITLE_TIME_BASE = Fraction(1, 1000)
# FFmpeg's own default header, for a text decoder that makes none.
_DEFAULT_ASS_HEADER = (
    b"[Script Info]\nScriptType: v4.00+\nPlayResX: 384\nPlayResY: 288\n\n[V4+ Styles]\n"
    b"Format: Name, Fontname, Fontsize, PrimaryColour, SecondaryColour, OutlineColour, BackColour, Bold, Italic, "
    b"Underline, StrikeOut, ScaleX, ScaleY, Spacing, Angle, BorderStyle, Outline, Shadow, Alignment, MarginL, "
    b"MarginR, MarginV, Encoding\nStyle: Default,Arial,16,&Hffffff,&Hffffff,&H0,&H0,0,0,0,0,100,100,0,0,1,1,0,2,10,10,"
    b"10,0\n\n[Events]\nFormat: Layer, Start, End, Style, Name, MarginL, MarginR, MarginV, Effect, Text\n"
)


class _Reencoder:
    """One audio stream decoded and re-encoded as AAC at its own layout and rate, cut to the output's span."""

    def __init__(self, source: av.AudioStream, stream: av.AudioStream, origin: Fraction, span: Fraction) -> None:
        self.stream = stream
        self._source = source
        self._rate = source.codec_context.sample_rate
        self._layout = source.codec_context.layout.name
        self._resampler = av.AudioResampler(format="fltp", layout=self._layout, rate=self._rate)
        self._skip = round(origin * self._rate)  # samples before the first video frame
        self._limit = round(span * self._rate)
        self._written = 0

    def feed(self, packet: av.Packet, out: av.container.OutputContainer) -> None:
        for frame in self._source.codec_context.decode(packet):
            for resampled in self._resampler.resample(frame):
                self._write(resampled.to_ndarray(), out)

    def _write(self, samples: np.ndarray, out: av.container.OutputContainer) -> None:
        if self._skip:
            cut = min(self._skip, samples.shape[1])
            samples, self._skip = samples[:, cut:], self._skip - cut
        samples = samples[:, : self._limit - self._written]
        if not samples.shape[1]:
            return
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(samples, dtype=np.float32), format="fltp", layout=self._layout
        )
        frame.sample_rate = self._rate
        frame.time_base = Fraction(1, self._rate)
        frame.pts = self._written
        self._written += samples.shape[1]
        for packet in self.stream.encode(frame):
            out.mux(packet)

    def flush(self, out: av.container.OutputContainer) -> None:
        for resampled in self._resampler.resample(None):
            self._write(resampled.to_ndarray(), out)
        for packet in self.stream.encode(None):
            out.mux(packet)
