"""What a source file is, before any frame is decoded: its first video stream described, or a MediaError naming
the cause (missing, empty, a folder, no video, a frame too large, a rate that is broken metadata)."""

from __future__ import annotations

import os
import stat
from fractions import Fraction

import av
import av.container
from pydantic import BaseModel, ConfigDict

from k6vsr_core.errors import MediaError
from k6vsr_core.media.checking import ColourTags
from k6vsr_core.media.colour import frame_colour
from k6vsr_core.media.hdr import HdrMetadata, frame_hdr

PathLike = str | os.PathLike[str]

# Anything above this is broken timing metadata (e.g. a 1/90000 tick taken as a
# frame rate), not a real capture rate.
_MAX_SOURCE_FPS = 1000.0
# Larger frames are refused before anything is decoded: one decoded frame of a file that declares, say,
# 60000x60000 would take gigabytes, and no delivery tier or model output is anywhere near that size (8K is 33 MP).
MAX_SOURCE_SIDE = 8192
MAX_SOURCE_PIXELS = 40_000_000


class VideoProbe(BaseModel):
    """What the pipeline needs to know about a source video before decoding it.

    ``width``, ``height`` and ``pix_fmt`` describe the first decoded frame, i.e.
    what :func:`read_frames` returns.  ``rotation`` is the display-matrix
    angle in degrees counter-clockwise (PyAV's convention, range -180..180), 0
    when the file carries none; decoded frames are *not* rotated. ``colour`` is the first frame's colour tags
    (``unspecified`` where the stream gives none), ``bit_depth`` its luma depth and ``hdr`` its mastering-display and
    content-light metadata, if any.
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
    colour: ColourTags = ColourTags(primaries="unspecified", transfer="unspecified", matrix="unspecified", range="tv")
    bit_depth: int = 8
    hdr: HdrMetadata | None = None
    # The pixels' shape (sample aspect ratio) as a fraction ("16/15" for PAL 4:3); None where they are square.
    sample_aspect: str | None = None


def open_input(path: str) -> av.container.InputContainer:
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


def video_stream(container: av.container.InputContainer, path: str) -> av.VideoStream:
    if not container.streams.video:
        kinds = sorted({stream.type for stream in container.streams})
        found = f" (found only: {', '.join(kinds)})" if kinds else ""
        raise MediaError(path, f"no video stream{found}")
    stream = container.streams.video[0]
    if stream.codec_context is None:
        # FFmpeg found a video track but no decoder parameters: a cut-off header or an unsupported codec.
        raise MediaError(path, "the video stream cannot be decoded (unknown codec, or a damaged or truncated header)")
    return stream


def _source_rate(stream: av.VideoStream, path: str) -> Fraction:
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
    return Fraction(rate)


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


def _sample_aspect(stream: av.VideoStream) -> str | None:
    """The container's sample aspect ratio, else the stream's (FFmpeg's own guess); None for square or untold."""
    sar = stream.sample_aspect_ratio
    return None if not sar or sar == 1 else str(sar)


def _probe_file(path: str) -> VideoProbe:
    with open_input(path) as container:
        stream = video_stream(container, path)
        # The header's size, checked before the first frame is decoded (which is what could exhaust memory).
        _check_frame_size(path, stream.codec_context.width, stream.codec_context.height, "declared")
        rate = _source_rate(stream, path)
        fps = float(rate)
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
            rate=str(rate),
            colour=frame_colour(first),
            bit_depth=first.format.components[0].bits,
            hdr=frame_hdr(first),
            sample_aspect=_sample_aspect(stream),
        )


def probe(path: PathLike) -> VideoProbe:
    """Describe the first video stream of ``path``, or raise :class:`MediaError`.

    ``num_frames`` is the container's frame count when it has one, otherwise
    the number of video packets; either may be wrong for damaged or
    variable-rate files: a run counts the frames by decoding them (:func:`scan_frames`).
    """
    return _probe_file(os.fspath(path))
