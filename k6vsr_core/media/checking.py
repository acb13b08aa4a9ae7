"""The health check before publish: a written output decoded once and compared with what was planned (its frame
count, duration, streams and colour tags), so a file that does not hold what the plan said is never published."""

from __future__ import annotations

import os
from fractions import Fraction

import av
from pydantic import BaseModel, ConfigDict

from k6vsr_core.errors import PipelineError
from k6vsr_core.media.clock import MATROSKA_TICK, Timeline
from k6vsr_core.media.hdr import HdrMetadata, frame_hdr, hdr_differences

# As probing's, not imported from it: probing describes a source's colour with this module's tags.
PathLike = str | os.PathLike[str]

# FFmpeg's names for the codes of its colour enums (libavutil/pixfmt.h), for messages and plans alike.
PRIMARIES = {1: "bt709", 2: "unspecified", 4: "bt470m", 5: "bt470bg", 6: "smpte170m", 7: "smpte240m", 9: "bt2020"}
TRANSFERS = {
    1: "bt709",
    2: "unspecified",
    4: "gamma22",
    5: "gamma28",
    6: "smpte170m",
    7: "smpte240m",
    8: "linear",
    13: "iec61966-2-1",
    14: "bt2020-10",
    15: "bt2020-12",
    16: "smpte2084",
    18: "arib-std-b67",
}
MATRICES = {0: "gbr", 1: "bt709", 2: "unspecified", 5: "bt470bg", 6: "smpte170m", 7: "smpte240m", 9: "bt2020nc"}
RANGES = {0: "unspecified", 1: "tv", 2: "pc"}


def _name(table: dict[int, str], code: int) -> str:
    return table.get(code, str(code))


class ColourTags(BaseModel):
    """A video stream's colour description, in FFmpeg's names (`bt709`, `smpte2084`, `tv`, ...)."""

    model_config = ConfigDict(frozen=True)

    primaries: str
    transfer: str
    matrix: str
    range: str

    @classmethod
    def of_codes(cls, primaries: int, transfer: int, matrix: int, range_: int) -> ColourTags:
        return cls(
            primaries=_name(PRIMARIES, primaries),
            transfer=_name(TRANSFERS, transfer),
            matrix=_name(MATRICES, matrix),
            range=_name(RANGES, range_),
        )

    def describe(self) -> str:
        return f"{self.primaries}/{self.transfer}/{self.matrix}/{self.range}"


# What k6vsr writes: BT.709 limited range for YUV; RGB (lossless FFV1) carries no tags.
BT709_TV = ColourTags(primaries="bt709", transfer="bt709", matrix="bt709", range="tv")
UNTAGGED = ColourTags(primaries="unspecified", transfer="unspecified", matrix="unspecified", range="unspecified")


class PlannedOutput(BaseModel):
    """What an output file must hold: the video stream as the plan and the encoding say, then the other streams in
    order, each as `kind:codec` in FFmpeg's decoder names (`audio:aac`, `subtitle:mov_text`)."""

    model_config = ConfigDict(frozen=True)

    frames: int
    frame_rate: str  # exact, as a fraction ("30000/1001"); a timeline's mean
    width: int
    height: int
    codec: str
    pix_fmt: str
    colour: ColourTags
    streams: tuple[str, ...] = ()
    sample_aspect: str = "1"  # the pixels' shape (SAR) as a fraction; "1": square (or untagged)
    chapters: int = 0
    timeline: Timeline | None = None  # every frame's own time, where a variable rate is kept
    hdr: HdrMetadata | None = None  # the static HDR metadata the first frame carries; None: none

    @property
    def duration_s(self) -> Fraction:
        return self.timeline.duration_s if self.timeline is not None else self.frames / Fraction(self.frame_rate)


class OutputMismatch(PipelineError):
    """A written output that does not hold what was planned; it is removed, never published."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path, self.problems = path, problems
        super().__init__(f"{path}: the output does not match its plan, so it is not published: {'; '.join(problems)}")

    def __reduce__(self) -> tuple[type[OutputMismatch], tuple[str, list[str]]]:
        return (type(self), (self.path, self.problems))


class _Seen(BaseModel):
    frames: int
    duration_s: Fraction | None
    header_duration_s: Fraction | None
    width: int
    height: int
    codec: str
    pix_fmt: str
    colour: ColourTags
    streams: tuple[str, ...]
    sample_aspect: str
    chapters: int
    times: tuple[Fraction, ...]  # the frames' times from the first, in display order
    hdr: HdrMetadata | None  # the first decoded frame's


def _kind(stream: av.stream.Stream) -> str:
    if stream.type == "attachment":
        return f"attachment:{stream.name}"
    name = stream.codec_context.name if stream.codec_context is not None else "unknown"
    return f"{stream.type}:{name}"


_DISCARD_ALL = 48  # FFmpeg's AVDISCARD_ALL


def _shown(stream: av.stream.Stream) -> bool:
    """Not a track the demuxer itself hides: QuickTime's chapter titles are a text track it reads as chapters."""
    return stream.discard != _DISCARD_ALL


def _decode(path: str) -> _Seen:
    with av.open(path) as container:
        if not container.streams.video:
            raise OutputMismatch(path, ["it holds no video stream"])
        video = container.streams.video[0]
        codec = video.codec_context
        frames, first, last, hdr = 0, None, None, None
        stamps = []
        for frame in container.decode(video):
            if not frames:
                hdr = frame_hdr(frame)
            frames += 1
            if frame.pts is not None:
                stamps.append(frame.pts)
                first = frame.pts if first is None else min(first, frame.pts)
                last = frame.pts if last is None else max(last, frame.pts)
        base = Fraction(video.time_base) if video.time_base else None
        # The frames' span plus one frame (at the stream's own average rate): what a player shows.
        rate = Fraction(video.average_rate) if video.average_rate else None
        span = None
        if base is not None and first is not None and last is not None and rate:
            span = (last - first) * base + 1 / rate
        header = video.duration * base if video.duration and base is not None else None
        return _Seen(
            frames=frames,
            duration_s=span,
            header_duration_s=header,
            width=codec.width,
            height=codec.height,
            # The codec's own name, whichever decoder read it (libdav1d for AV1).
            codec=codec.codec.canonical_name,
            pix_fmt=codec.pix_fmt or "",
            colour=ColourTags.of_codes(codec.color_primaries, codec.color_trc, codec.colorspace, codec.color_range),
            streams=tuple(_kind(s) for s in container.streams if s.index != video.index and _shown(s)),
            sample_aspect=str(video.sample_aspect_ratio or 1),
            chapters=len(container.chapters()),
            times=() if base is None or first is None else tuple((pts - first) * base for pts in sorted(stamps)),
            hdr=hdr,
        )


def _same_pix_fmt(seen: str, planned: str, codec: str) -> bool:
    if codec == "prores":
        # FFmpeg's ProRes decoder gives a 4444 stream as 10- or 12-bit by the depth its container states (a stream
        # copy keeps 10, the encoder's own file says 12): the coded pictures are the same.
        return seen.replace("12le", "10le") == planned
    return seen == planned


def _differences(seen: _Seen, planned: PlannedOutput) -> list[str]:
    problems = []
    if seen.frames != planned.frames:
        problems.append(f"{seen.frames} frame(s) decode, {planned.frames} planned")
    # Half a frame: Matroska keeps milliseconds, so a frame's time may be off by less than that.
    half_frame = 1 / (2 * Fraction(planned.frame_rate))
    spans = (("frames span", seen.duration_s), ("header says", seen.header_duration_s))
    if planned.timeline is not None:
        # Each frame's own time, to Matroska's clock; the last one lasts as planned, not the mean's frame.
        half_frame = MATROSKA_TICK
        problems += _timeline_differences(seen.times, planned.timeline)
        last = seen.times[-1] + planned.timeline.duration_s - planned.timeline.start_s(-2) if seen.times else None
        spans = (("frames span", last), ("header says", seen.header_duration_s))
    for what, duration in spans:
        if duration is not None and abs(duration - planned.duration_s) > half_frame:
            problems.append(f"duration {float(duration):.3f} s ({what}), {float(planned.duration_s):.3f} s planned")
    if (seen.width, seen.height) != (planned.width, planned.height):
        problems.append(f"size {seen.width}x{seen.height}, {planned.width}x{planned.height} planned")
    if seen.codec != planned.codec:
        problems.append(f"codec {seen.codec}, {planned.codec} planned")
    if not _same_pix_fmt(seen.pix_fmt, planned.pix_fmt, seen.codec):
        problems.append(f"pixel format {seen.pix_fmt}, {planned.pix_fmt} planned")
    if Fraction(seen.sample_aspect) != Fraction(planned.sample_aspect):
        problems.append(f"sample aspect ratio {seen.sample_aspect}, {planned.sample_aspect} planned")
    if seen.colour != planned.colour:
        problems.append(f"colour tags {seen.colour.describe()}, {planned.colour.describe()} planned")
    if seen.chapters != planned.chapters:
        problems.append(f"{seen.chapters} chapter(s), {planned.chapters} planned")
    if seen.streams != planned.streams:
        shown = ", ".join(seen.streams) or "none"
        problems.append(f"other streams {shown}, {', '.join(planned.streams) or 'none'} planned")
    return problems


def _timeline_differences(times: tuple[Fraction, ...], planned: Timeline) -> list[str]:
    """The first frame shown off its planned time by more than Matroska's clock, if any."""
    for index, (seen, time) in enumerate(zip(times, planned.stamps, strict=False)):
        wanted = time * planned.tick
        if abs(seen - wanted) > MATROSKA_TICK:
            return [f"frame {index} at {float(seen):.4f} s, {float(wanted):.4f} s planned"]
    return []


def check_output(path: PathLike, planned: PlannedOutput) -> None:
    """Decode `path` once and raise :class:`OutputMismatch`, naming every difference, unless it holds `planned`:
    the frame count, the duration (within half a frame), the video's size, codec, pixel format and colour tags,
    the other streams in order, and the HDR metadata."""
    path = os.fspath(path)
    try:
        seen = _decode(path)
    except av.error.FFmpegError as exc:
        raise OutputMismatch(path, [f"it does not decode ({exc})"]) from exc
    problems = _differences(seen, planned) + hdr_differences(seen.hdr, planned.hdr)
    if problems:
        raise OutputMismatch(path, problems)
