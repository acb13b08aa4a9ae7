"""Writing the output: RGB frames (and mono audio) encoded as a reproducible file, a window's frames as a segment,
and the segments joined by stream copy, with the audio or the source's own streams added."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from fractions import Fraction

import av
import av.container
import numpy as np
from av.video.reformatter import ColorRange, Colorspace

from k6vsr_core.errors import MediaError
from k6vsr_core.media.audio import AUDIO_BIT_RATE, AUDIO_CODEC, AUDIO_SAMPLE_RATE, samples_for, trim_audio
from k6vsr_core.media.checking import BT709_TV, UNTAGGED, ColourTags, PlannedOutput
from k6vsr_core.media.clock import FrameRate, Timeline, span_s
from k6vsr_core.media.colour import MATRIX_CODES, PRIMARY_CODES, TRANSFER_CODES
from k6vsr_core.media.encoding import DEEP_PIX_FMTS, HDR_METADATA_CODECS, MIN_SIZES, VideoEncoding
from k6vsr_core.media.hdr import HdrMetadata, hdr_parameters
from k6vsr_core.media.probing import PathLike
from k6vsr_core.media.streams import SourceStreams, carried_chapters, carried_streams
from k6vsr_core.media.typed import stream_as, time_base

# The contract's rates are whole numbers; `--fps source` keeps the source's exact rational rate (30000/1001), or a
# variable-rate source's frame times themselves (a `Timeline`).
_CONTRACT = VideoEncoding()
HEVC_MIN_SIDE = MIN_SIZES["hevc"][0]
# swscale's matrix for each YUV matrix the output can be written with (media.colour: the two BT.601 ones are one).
_SWS_MATRICES = {
    "bt709": Colorspace.ITU709,
    "smpte170m": Colorspace.SMPTE170M,
    "bt470bg": Colorspace.ITU601,
    "bt2020nc": Colorspace.BT2020,
}


def _check_frames(frames: np.ndarray, encoding: VideoEncoding = _CONTRACT) -> None:
    if not isinstance(frames, np.ndarray):
        raise ValueError(f"frames must be a numpy array, got {type(frames).__name__}")
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must have shape (T, H, W, 3), got {frames.shape}")
    if frames.dtype == np.uint16:
        if not encoding.is_deep:
            # Writing them as 8 bits would silently drop the precision they were decoded with.
            raise ValueError(
                f"16-bit frames need a 10-bit pixel format ({', '.join(DEEP_PIX_FMTS)}), not {encoding.stream_pix_fmt}"
            )
    elif frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 or uint16 RGB, got dtype {frames.dtype}")
    if frames.shape[0] < 1 or frames.shape[1] < 1 or frames.shape[2] < 1:
        raise ValueError(f"frames must hold at least one non-empty frame, got shape {frames.shape}")


def _prepare_audio(audio: np.ndarray, num_frames: int, fps: FrameRate) -> np.ndarray | None:
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim != 1:
        raise ValueError(f"audio must be a 1-D mono array at {AUDIO_SAMPLE_RATE} Hz, got shape {audio.shape}")
    audio = np.clip(trim_audio(audio, num_frames, fps), -1.0, 1.0)
    return audio if audio.size else None


def _encoder_frames(
    frames: np.ndarray, fps: FrameRate, encoding: VideoEncoding = _CONTRACT, colour: ColourTags = BT709_TV
) -> Iterator[av.VideoFrame]:
    """Yield frames in the stream's pixel format (`colour`'s matrix for YUV), padded to even sides where the chroma
    is subsampled, pts = index (a timeline's: each frame's own time)."""
    height, width = encoding.stored_size(frames.shape[1], frames.shape[2])
    pad_h, pad_w = height - frames.shape[1], width - frames.shape[2]
    time_base = fps.tick if isinstance(fps, Timeline) else 1 / Fraction(fps)
    for index, rgb in enumerate(frames):
        if pad_h or pad_w:
            rgb = np.pad(rgb, ((0, pad_h), (0, pad_w), (0, 0)), mode="edge")
        frame = av.VideoFrame.from_ndarray(
            np.ascontiguousarray(rgb), format="rgb24" if rgb.dtype == np.uint8 else "rgb48le"
        )
        if encoding.is_rgb:
            frame = frame.reformat(format=encoding.stream_pix_fmt)
        else:
            # Convert explicitly so the matrix used matches the tags on the stream;
            # left implicit, swscale would use BT.601 and tag nothing, and players
            # would guess (usually BT.709 for HD) and shift the colours.
            frame = frame.reformat(
                format=encoding.stream_pix_fmt,
                dst_colorspace=_SWS_MATRICES[colour.matrix],
                dst_color_range=ColorRange.MPEG,
            )
            if encoding.tags_frames:
                # ProRes writes each frame's own primaries and transfer into its header; the stream's are not used.
                frame.color_primaries = PRIMARY_CODES[colour.primaries]
                frame.color_trc = TRANSFER_CODES[colour.transfer]
        frame.pts = fps.stamps[index] if isinstance(fps, Timeline) else index
        frame.time_base = time_base
        yield frame


def _add_video_stream(
    container: av.container.OutputContainer,
    width: int,
    height: int,
    fps: FrameRate,
    rotation: int,
    encoding: VideoEncoding = _CONTRACT,
    colour: ColourTags = BT709_TV,
    hdr: HdrMetadata | None = None,
    sample_aspect: Fraction | None = None,
) -> av.VideoStream:
    # A timeline's frames each keep their own time, in its ticks; the stream states their mean rate.
    nominal = fps.mean_rate.limit_denominator(1001) if isinstance(fps, Timeline) else fps
    added = container.add_stream(encoding.encoder, rate=nominal, options=_encoder_options(encoding, hdr))
    video = stream_as(added, av.VideoStream)
    if sample_aspect is not None:
        video.codec_context.sample_aspect_ratio = sample_aspect
    if rotation:
        # Pixels stay as stored (the model never sees rotation); players turn them as they did the source.
        video.set_display_rotation(rotation)
    video.height, video.width = encoding.stored_size(height, width)
    video.pix_fmt = encoding.stream_pix_fmt
    video.codec_context.time_base = fps.tick if isinstance(fps, Timeline) else 1 / Fraction(fps)
    if not encoding.is_rgb:
        video.codec_context.colorspace = MATRIX_CODES[colour.matrix]
        video.codec_context.color_primaries = PRIMARY_CODES[colour.primaries]
        video.codec_context.color_trc = TRANSFER_CODES[colour.transfer]
        video.codec_context.color_range = ColorRange.MPEG
    if encoding.codec == "ffv1":
        # FFV1's slice layout follows the thread count: one thread keeps the bytes the same on every host.
        video.codec_context.thread_count = 1
    return video


def _encoder_options(encoding: VideoEncoding, hdr: HdrMetadata | None) -> dict[str, str]:
    options = encoding.options()
    if hdr is not None:
        # PyAV cannot hand the encoder HDR side data; the encoder writes it from its own parameters.
        option, value = hdr_parameters(encoding.codec, hdr)
        options[option] = f"{options[option]}:{value}" if option in options else value
    return options


def _mux(
    container: av.container.OutputContainer,
    frames: np.ndarray,
    fps: FrameRate,
    audio: np.ndarray | None,
    rotation: int,
    encoding: VideoEncoding = _CONTRACT,
    colour: ColourTags = BT709_TV,
    hdr: HdrMetadata | None = None,
    sample_aspect: Fraction | None = None,
) -> None:
    video = _add_video_stream(
        container, frames.shape[2], frames.shape[1], fps, rotation, encoding, colour, hdr, sample_aspect
    )

    sound = None
    if audio is not None:
        sound = container.add_stream(AUDIO_CODEC, rate=AUDIO_SAMPLE_RATE, layout="mono")
        sound.bit_rate = AUDIO_BIT_RATE

    if isinstance(fps, Timeline):
        # Held until the last is out: its decode times are made from every packet's (`_decode_times`).
        packets = [packet for frame in _encoder_frames(frames, fps, encoding, colour) for packet in video.encode(frame)]
        packets += video.encode(None)
        stamps = [packet.pts for packet in packets if packet.pts is not None]
        if len(stamps) != len(packets):
            raise RuntimeError(f"the {encoding.encoder} encoder gave a packet without a time")
        for packet, (dts, duration) in zip(packets, _decode_times(stamps, fps.stamps), strict=True):
            packet.dts, packet.duration = dts, duration
            container.mux(packet)
    else:
        decoded: list[int] = []
        for frame in _encoder_frames(frames, fps, encoding, colour):
            container.mux(_sane_decode_times(video.encode(frame), decoded))
        container.mux(_sane_decode_times(video.encode(None), decoded))

    if sound is not None and audio is not None:
        samples = av.AudioFrame.from_ndarray(audio[np.newaxis, :], format="fltp", layout="mono")
        samples.sample_rate = AUDIO_SAMPLE_RATE
        samples.time_base = Fraction(1, AUDIO_SAMPLE_RATE)
        samples.pts = 0
        container.mux(sound.encode(samples))
        container.mux(sound.encode(None))


# More frames than any encoder here holds back for reordering (x264 and x265 at most 3 with their B-frames).
_MOST_REORDERED = 16


def _sane_decode_times(packets: list[av.Packet], decoded: list[int]) -> list[av.Packet]:
    """`packets`, each with a decode time an encoder can mean; `decoded` holds the decode times of the packets muxed
    before them.

    x265 (as built into PyAV's wheels) leaves a one-frame stream's decode time uninitialised: any number, often far
    below zero, which the MP4 muxer refuses ("not yet implemented"), so a one-frame shot's segment failed at random.
    A decode time after its packet's showing, more than `_MOST_REORDERED` frames before it, or not after the one
    before is none the encoder meant: the packet gets the next one (its showing time, for the first). Every other is
    kept, so every stream the encoders time properly keeps its bytes."""
    for packet in packets:
        dts, pts = packet.dts, packet.pts
        if pts is not None and (
            dts is None or not pts - _MOST_REORDERED <= dts <= pts or (decoded and dts <= decoded[-1])
        ):
            packet.dts = decoded[-1] + 1 if decoded else pts
        if packet.dts is not None:
            decoded.append(packet.dts)
    return packets


def _decode_times(shown: list[int], stamps: tuple[int, ...]) -> list[tuple[int, int]]:
    """Each packet's decode time and duration for packets in decode order shown at `shown` (times among `stamps`,
    a timeline's): packet j decodes at frame j's time less the one shift that puts none after its own showing.

    Decode times then rise as the frames' times do, however their durations vary: the encoder's own, made for a
    constant pace, may not rise across a join. Each packet lasts as long as its frame is shown (QuickTime's edit list
    ends at the latest frame's end), except the last decoded, which lasts the clip's last frame slot: MP4 takes a
    track's length from the decode times and that last duration, and both then make the clip's length.
    """
    shift = max(0, *(stamps[j] - pts for j, pts in enumerate(shown)))
    lasts = dict(zip(stamps, stamps[1:], strict=False))
    times = [(stamps[j] - shift, lasts[pts] - pts) for j, pts in enumerate(shown)]
    times[-1] = (times[-1][0], stamps[len(shown)] - stamps[len(shown) - 1])
    return times


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


def _check_rate(fps: object, num_frames: int | None = None) -> FrameRate:
    if isinstance(fps, Timeline):
        if num_frames is not None and fps.frames != num_frames:
            raise ValueError(f"a timeline of {fps.frames} frame(s) for {num_frames} frame(s)")
        return fps
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
    colour: ColourTags = BT709_TV,
    hdr: HdrMetadata | None = None,
    sample_aspect: Fraction | None = None,
) -> None:
    """Encode RGB frames (and optional mono audio) as a video file at ``path``.

    - ``frames``: ``(T, H, W, 3)`` uint8 RGB (uint16 for a 10-bit pixel format,
      as ``read_frames(..., depth=16)`` gives); frame ``i`` gets pts ``i`` in a
      ``1/fps`` time base.  By default video is libx264, yuv420p, CRF 18, tagged
      BT.709, in MP4 (the contract's file); ``encoding`` picks another codec,
      quality, preset or pixel format (FFV1 goes in Matroska); ``colour`` the
      YUV matrix and tags (a source's own, :func:`output_colour`); ``hdr`` the
      mastering-display and content-light metadata (HEVC, H.264 and AV1 carry it).
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
    - ``sample_aspect``: the pixels' shape (SAR) to write, for non-square
      pixels; None writes none (square).
    - The container follows ``encoding``, whatever the file name, so callers can
      write to a temporary name and rename it.  The output is byte-identical for
      identical inputs (no timestamps or library versions are embedded).
    - The file is written in place; if encoding fails it is removed and a
      :class:`MediaError` naming ``path`` is raised.
    """
    fps = _check_rate(fps, len(frames) if isinstance(frames, np.ndarray) and frames.ndim == 4 else None)
    encoding = encoding or _CONTRACT
    _check_frames(frames, encoding)
    if colour.matrix not in _SWS_MATRICES and not encoding.is_rgb:
        raise ValueError(f"matrix {colour.matrix} cannot be written; allowed: {', '.join(_SWS_MATRICES)}")
    if hdr is not None and encoding.codec not in HDR_METADATA_CODECS:
        raise ValueError(
            f"HDR metadata is written by {', '.join(HDR_METADATA_CODECS)} only, not by codec={encoding.codec}"
        )
    # x265 gives run-to-run different output below its minimum, and corrupts its heap on smaller frames still.
    if (problem := encoding.size_problem(frames.shape[1], frames.shape[2])) is not None:
        raise ValueError(problem)
    if audio is not None:
        audio = _prepare_audio(audio, frames.shape[0], fps)

    path = os.fspath(path)
    with _whole_or_removed(path, "write video"), _open_output(path, encoding) as container:
        _mux(container, frames, fps, audio, int(rotation), encoding, colour, hdr, sample_aspect)


def write_segment(
    path: PathLike,
    frames: np.ndarray,
    fps: FrameRate,
    encoding: VideoEncoding | None = None,
    colour: ColourTags = BT709_TV,
    sample_aspect: Fraction | None = None,
    hdr: HdrMetadata | None = None,
) -> None:
    """One window's frames as a video-only file that starts on a key frame, for :func:`concat_segments` (which
    copies its colour tags and HDR metadata with its packets)."""
    write_video(path, frames, fps, None, encoding=encoding, colour=colour, hdr=hdr, sample_aspect=sample_aspect)


def concat_segments(
    segments: list[str],
    path: PathLike,
    fps: FrameRate,
    audio: np.ndarray | None,
    num_frames: int,
    rotation: int = 0,
    encoding: VideoEncoding | None = None,
    original: str | None = None,
    sample_aspect: Fraction | None = None,
) -> None:
    """Join video-only segments by stream copy and add the audio, as :func:`write_video` would have written them.

    Each segment's packets are copied, shifted by the frames before it; the audio (1-D float at
    ``AUDIO_SAMPLE_RATE``, e.g. a memory map: it is read a segment's span at a time) is trimmed to ``num_frames``
    and encoded as :func:`write_video` does, interleaved segment by segment. Nothing is decoded or re-encoded, so
    memory stays one segment's packets, whatever the length. On failure the file is removed.

    ``original``: a source file whose every audio and subtitle stream (and container metadata) is carried over
    instead, trimmed to the output's span (:class:`SourceStreams`); ``audio`` is then ignored.
    ``sample_aspect``: the pixels' shape written in the container, as the segments hold it in their streams.
    """
    if not segments:
        raise ValueError("no segments to join")
    path = os.fspath(path)
    fps = _check_rate(fps, num_frames if isinstance(fps, Timeline) else None)
    encoding = encoding or _CONTRACT
    limit = samples_for(num_frames, fps)
    timed = _TimedPackets(segments, fps) if isinstance(fps, Timeline) else None
    frame_base = fps.tick if isinstance(fps, Timeline) else 1 / Fraction(fps)
    with _whole_or_removed(path, "join the segments"):
        with _open_output(path, encoding) as out:
            with av.open(segments[0]) as first:
                video = _video_like(out, first.streams.video[0])
            video.codec_context.bit_rate = 0
            if sample_aspect is not None:
                video.codec_context.sample_aspect_ratio = sample_aspect
            if rotation:
                video.set_display_rotation(int(rotation))
            sound = None
            if original is None and audio is not None and min(limit, len(audio)) > 0:
                sound = out.add_stream(AUDIO_CODEC, rate=AUDIO_SAMPLE_RATE, layout="mono")
                sound.bit_rate = AUDIO_BIT_RATE
            carried = SourceStreams(original, out, span_s(num_frames, fps)) if original is not None else None
            offset = 0
            sent = 0
            delay = 0 if timed is not None else max(_decode_delay(segment, frame_base) for segment in segments)
            for index, segment in enumerate(segments):
                if timed is not None:
                    offset += timed.copy(out, video, index)
                else:
                    offset += _copy_segment(out, video, segment, offset, frame_base, delay)
                if sound is not None and audio is not None:
                    upto = min(limit, len(audio), samples_for(offset, fps))
                    sent = _encode_audio(out, sound, audio, sent, upto)
                if carried is not None:
                    carried.feed(span_s(offset, fps))
            if sound is not None:
                out.mux(sound.encode(None))
            if carried is not None:
                carried.finish()
    if offset != num_frames:
        _remove_quietly(path)
        raise MediaError(path, f"the segments hold {offset} frames, expected {num_frames}")


def _video_like(out: av.container.OutputContainer, template: av.VideoStream) -> av.VideoStream:
    """A stream for `template`'s packets: the codec taken from the template itself where its decoder has no
    encoder of the same name (libdav1d reads AV1), and QuickTime's sample tag kept, which names a ProRes profile
    (apch is 422 HQ, ap4h 4444) that a plain remux would lose."""
    name = template.codec_context.codec.name
    video = out.add_stream_from_template(template, opaque=not _encodes(name))
    if out.format.name == "mov":
        video.codec_context.codec_tag = template.codec_context.codec_tag
    return video


def _encodes(name: str) -> bool:
    try:
        av.Codec(name, "w")
    except av.codec.codec.UnknownCodecError:
        return False
    return True


def _decode_delay(segment: str, frame_base: Fraction) -> int:
    """How many frames a segment's first dts stands before its first pts (its B-frame delay: 0 for a one-frame
    segment, 2 for a long x264 one)."""
    with av.open(segment) as source:
        stream = source.streams.video[0]
        for packet in source.demux(stream):
            if packet.size and packet.dts is not None:
                return max(0, -round(packet.dts * time_base(stream) / frame_base))
    return 0


def _copy_segment(
    out: av.container.OutputContainer,
    video: av.VideoStream,
    segment: str,
    offset: int,
    frame_base: Fraction,
    delay: int,
) -> int:
    """Mux one segment's packets, shifted by `offset` frames; returns its frame count.

    Each segment's frames start at pts 0 and its dts at minus its own B-frame delay. Segments' delays differ (a
    one-frame segment has none), so every dts is moved back to the largest delay of the join: a segment's dts then
    run on from the last one's, never back, and the muxer has no out-of-order dts to "fix" by breaking the timing.
    """
    frames = 0
    with av.open(segment) as source:
        stream = source.streams.video[0]
        own_delay = None
        for packet in source.demux(stream):
            if packet.size == 0 or packet.pts is None or packet.dts is None:
                continue
            dts = round(packet.dts * time_base(stream) / frame_base)
            if own_delay is None:
                own_delay = max(0, -dts)
            packet.pts = round(packet.pts * time_base(stream) / frame_base) + offset
            packet.dts = dts + offset - (delay - own_delay)
            packet.duration = 1
            packet.time_base = frame_base
            packet.stream = video
            out.mux(packet)
            frames += 1
    return frames


class _TimedPackets:
    """Segments' packets placed on a clip's timeline: each frame at its own time, whatever clock its segment's
    container rounded it to (a frame is known by its rank in its segment's display order), decoded at the times
    `_decode_times` makes for the whole clip."""

    def __init__(self, segments: list[str], timeline: Timeline) -> None:
        self._segments, self._timeline = segments, timeline
        self._frames: list[list[int]] = []  # each segment's packets' frames on the timeline, in decode order
        first = 0
        for segment in segments:
            with av.open(segment) as source:
                stream = source.streams.video[0]
                stamps = [p.pts for p in source.demux(stream) if p.size and p.pts is not None and p.dts is not None]
            order = {pts: first + rank for rank, pts in enumerate(sorted(stamps))}
            self._frames.append([order[pts] for pts in stamps])
            first += len(stamps)
        if first != timeline.frames:
            raise ValueError(f"the segments hold {first} frames, the timeline {timeline.frames}")
        shown = [timeline.stamps[frame] for frames in self._frames for frame in frames]
        self._decode = iter(_decode_times(shown, timeline.stamps))

    def copy(self, out: av.container.OutputContainer, video: av.VideoStream, index: int) -> int:
        """Mux segment `index`'s packets (segments in order); returns its frame count."""
        frames = iter(self._frames[index])
        with av.open(self._segments[index]) as source:
            for packet in source.demux(source.streams.video[0]):
                if packet.size == 0 or packet.pts is None or packet.dts is None:
                    continue
                packet.pts = self._timeline.stamps[next(frames)]
                packet.dts, packet.duration = next(self._decode)
                packet.time_base = self._timeline.tick
                packet.stream = video
                out.mux(packet)
        return len(self._frames[index])


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


def planned_output(
    encoding: VideoEncoding,
    num_frames: int,
    fps: FrameRate,
    size: tuple[int, int],
    audio_samples: int = 0,
    original: str | None = None,
    colour: ColourTags = BT709_TV,
    sample_aspect: Fraction | None = None,
    hdr: HdrMetadata | None = None,
) -> PlannedOutput:
    """What :func:`write_video` or :func:`concat_segments` writes for `num_frames` frames of `size` (H, W) at
    `fps`, with `audio_samples` of mono audio (trimmed to the frames) or the streams of `original`: for
    :func:`k6vsr_core.media.checking.check_output` before the file is published. YUV outputs carry `colour`, and
    `hdr` where given."""
    fps = _check_rate(fps, num_frames if isinstance(fps, Timeline) else None)
    height, width = encoding.stored_size(*size)
    chapters = 0
    if original is not None:
        streams = carried_streams(original, encoding.container)
        chapters = carried_chapters(original, span_s(num_frames, fps))
    else:
        limit = samples_for(num_frames, fps)
        streams = (f"audio:{AUDIO_CODEC}",) if min(limit, audio_samples) > 0 else ()
    return PlannedOutput(
        frames=num_frames,
        frame_rate=str(fps.mean_rate if isinstance(fps, Timeline) else Fraction(fps)),
        timeline=fps if isinstance(fps, Timeline) else None,
        width=width,
        height=height,
        codec=encoding.codec_name,
        pix_fmt=encoding.stream_pix_fmt,
        colour=UNTAGGED if encoding.is_rgb else colour,
        streams=streams,
        sample_aspect=str(sample_aspect or 1),
        chapters=chapters,
        hdr=hdr,
    )
