"""The source's own audio and subtitle streams, chapters and attachments, carried into an output being written
(`--audio original`)."""

from __future__ import annotations

import warnings
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import av
import av.container
import numpy as np
from av.subtitles.stream import SubtitleStream

from k6vsr_core.media.audio import AUDIO_BIT_RATE, AUDIO_CODEC
from k6vsr_core.media.probing import open_input
from k6vsr_core.media.typed import stream_as, time_base

if TYPE_CHECKING:
    from av.container.core import Chapter  # a TypedDict of PyAV's stubs only

# Codecs each container takes by stream copy; any other audio is re-encoded as AAC at the source's layout and rate.
_COPY_AUDIO = {
    "mp4": {"aac", "mp3", "ac3", "eac3", "alac", "flac", "opus"},
    # QuickTime, for ProRes and DNxHR: the PCM of post-production as it is.
    "mov": {"aac", "mp3", "ac3", "eac3", "alac", "pcm_s16le", "pcm_s16be", "pcm_s24le", "pcm_s24be", "pcm_f32le"},
    "matroska": {"aac", "mp3", "ac3", "eac3", "alac", "flac", "opus", "vorbis", "pcm_s16le", "pcm_s24le", "pcm_f32le"},
}
_COPY_SUBTITLES = {
    "mp4": {"mov_text"},
    "mov": {"mov_text"},
    "matroska": {"subrip", "srt", "ass", "ssa", "webvtt", "hdmv_pgs_subtitle"},
}
# Text subtitles a container cannot hold as they are are converted to the text format it takes: MP4 (and MOV) hold only
# mov_text (3GPP timed text), and Matroska takes ASS, which keeps what mov_text styles.
_TEXT_SUBTITLES = {"subrip", "srt", "ass", "ssa", "webvtt", "mov_text", "text", "microdvd", "subviewer", "jacosub"}
_CONVERT_SUBTITLES = {"mp4": "mov_text", "mov": "mov_text", "matroska": "ass"}
# Container metadata worth keeping; encoder tags and the like describe the old file, not the new one.
_KEPT_METADATA = ("title", "language", "creation_time", "comment", "description", "artist", "date", "copyright")


def _codec_name(stream: av.stream.Stream) -> str:
    return stream.codec_context.name if stream.codec_context is not None else ""


def carry(stream: av.stream.Stream, container_format: str) -> tuple[str, str] | None:
    """How one source stream goes into an output of `container_format` (FFmpeg's muxer name): copied or encoded,
    and the codec it then has; None: it is left out (video, data, a picture subtitle the container cannot hold)."""
    name = _codec_name(stream)
    if stream.type == "audio":
        return ("copy", name) if name in _COPY_AUDIO.get(container_format, set()) else ("encode", AUDIO_CODEC)
    if stream.type == "subtitle":
        if name in _COPY_SUBTITLES.get(container_format, set()):
            return ("copy", name)
        if name in _TEXT_SUBTITLES and container_format in _CONVERT_SUBTITLES:
            return ("encode", _CONVERT_SUBTITLES[container_format])
    return None


def carried_streams(source: str, container_format: str) -> tuple[str, ...]:
    """The streams `--audio original` writes from `source` after the video, in order, as `kind:codec`, then the
    attachments as `attachment:<file name>`."""
    kinds, attachments = [], []
    with open_input(source) as container:
        for stream in container.streams:
            if stream.type == "attachment":
                if container_format in _ATTACHING:
                    attachments.append(f"attachment:{stream.name}")
            elif (carried := carry(stream, container_format)) is not None:
                kinds.append(f"{stream.type}:{carried[1]}")
    # Matroska keeps attachments apart from the tracks: they are read back after every track.
    return (*kinds, *attachments)


# The containers that hold attachments (fonts for ASS subtitles, cover art, notes): MP4 and QuickTime have no place.
_ATTACHING = ("matroska",)


def video_origin(container: av.container.InputContainer) -> Fraction:
    """When the source's first video frame starts, in seconds: the output's time zero."""
    video = container.streams.video[0] if container.streams.video else None
    start = video.start_time if video is not None and video.start_time is not None else 0
    return Fraction(start) * (time_base(video) if video is not None else 1)


def kept_chapters(container: av.container.InputContainer, span: Fraction) -> list[Chapter]:
    """The source's chapters on the output's clock (from its first video frame), cut to the output's `span`
    (seconds): one that ends before the start or starts at the end is left out, one that runs past the end ends
    there; each keeps its title and other metadata."""
    origin = video_origin(container)
    kept: list[Chapter] = []
    for chapter in container.chapters():
        base = chapter["time_base"]
        if base is None:  # FFmpeg gives every chapter one; without, its ticks are no time
            continue
        start = max(chapter["start"] * base - origin, Fraction(0))
        end = min(chapter["end"] * base - origin, span)
        if end <= start:
            continue
        ticks: Chapter = {
            "id": len(kept) + 1,
            "start": round(start / base),
            "end": round(end / base),
            "time_base": base,
            "metadata": chapter["metadata"],
        }
        kept.append(ticks)
    return kept


def carried_chapters(source: str, span: Fraction) -> int:
    """How many chapters `--audio original` writes from `source` into an output of `span` seconds."""
    with open_input(source) as container:
        return len(kept_chapters(container, span))


class SourceStreams:
    """Every audio and subtitle stream of a source, carried into an output being written, trimmed to `span`.

    Timestamps are taken relative to the source's first video frame, so what played together still does. Audio is
    copied packet by packet where the container takes the codec (the last packet may run past the end by less
    than one packet, ~21 ms for AAC) and otherwise decoded and re-encoded at the source's layout and rate, cut to
    the sample. Each stream's language tag goes with it; the container's title, creation time (and the like) too,
    and its chapters (cut to `span`) and, where the output's container holds them, its attachments.
    """

    def __init__(self, source: str, out: av.container.OutputContainer, span: Fraction) -> None:
        self._input = open_input(source)
        self._span = span
        self._done = False
        container_format = out.format.name.split(",")[0]
        for key, value in self._input.metadata.items():
            if key.lower() in _KEPT_METADATA:
                out.metadata[key] = value
        self._origin = video_origin(self._input)
        self._out = out
        out.set_chapters(kept_chapters(self._input, span))
        self._plans: dict[int, tuple[str, Any]] = {}  # input stream index -> (how, output stream or re-encoder)
        for stream in self._input.streams:
            if isinstance(stream, av.stream.AttachmentStream):
                _attach(stream, out, container_format, source)
                continue
            carried = carry(stream, container_format)
            if carried is None:
                if stream.type == "subtitle":
                    warnings.warn(
                        f"{source}: subtitle stream {stream.index} ({_codec_name(stream)}) is a picture format that "
                        f"{container_format} cannot hold; it is left out (Matroska keeps it: --codec ffv1)",
                        stacklevel=3,
                    )
                continue
            how, codec = carried
            if how == "copy":
                self._plans[stream.index] = ("copy", out.add_stream_from_template(stream))
            elif isinstance(stream, av.AudioStream):
                layout = stream.codec_context.layout.name
                added = out.add_stream(codec, rate=stream.codec_context.sample_rate, layout=layout)
                target = stream_as(added, av.AudioStream)
                target.bit_rate = AUDIO_BIT_RATE * max(1, stream.codec_context.channels)
                self._plans[stream.index] = ("encode", _Reencoder(stream, target, self._origin, span))
            else:
                converter = _SubtitleConverter(stream_as(stream, SubtitleStream), out, codec, self._origin, span)
                self._plans[stream.index] = ("encode", converter)
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


def _attach(
    stream: av.stream.AttachmentStream, out: av.container.OutputContainer, container_format: str, source: str
) -> None:
    if container_format not in _ATTACHING:
        warnings.warn(
            f"{source}: attachment {stream.name!r} ({stream.mimetype}) is left out: {container_format} holds no "
            "attachments (Matroska does: --codec ffv1)",
            stacklevel=4,
        )
        return
    if stream.name is None or stream.mimetype is None:
        warnings.warn(f"{source}: an attachment without a name or type is left out", stacklevel=4)
        return
    out.add_attachment(stream.name, stream.mimetype, stream.data)


class _SubtitleConverter:
    """One text subtitle stream decoded and encoded in the text format the output's container takes, each cue at
    its source time (relative to the first video frame) and cut to the output's span."""

    def __init__(
        self, source: SubtitleStream, out: av.container.OutputContainer, codec: str, origin: Fraction, span: Fraction
    ) -> None:
        self._source = source
        self._origin, self._span = origin, span
        decoder = source.codec_context
        decoder.open()  # a text decoder makes the ASS header the encoder needs when it opens
        self.stream = stream_as(out.add_stream(codec), SubtitleStream)
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
