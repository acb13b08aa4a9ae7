"""Interlaced sources: the field order a source declares or shows, and its frames deinterlaced by libavfilter's bwdif.

An interlaced frame holds two fields captured a field period apart; anything that moves is combed (every other line
displaced). The model was trained on progressive video and would upscale the combing as detail, so a combed source is
deinterlaced before the model sees it: one output frame per source frame (bwdif's `send_frame` mode), the rate and
the frame count unchanged.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Iterator
from fractions import Fraction
from typing import Literal, TypeVar

import av
import av.container
from pydantic import BaseModel, ConfigDict

from k6vsr_core.errors import MediaError
from k6vsr_core.media.probing import PathLike, open_input, video_stream

FieldOrder = Literal["tff", "bff"]
StreamFields = Literal["progressive", "tff", "bff", "interlaced", "unknown"]

K = TypeVar("K")  # what a frame is keyed by through the deinterlacer: its index or its timestamp

# The frames the picture is judged on: a few seconds of any rate, a fraction of a second of decoding at SD.
PICTURE_FRAMES = 120
# AVFieldOrder by display order: TB is coded top first but shown bottom first, BT the other way round.
_STREAM_ORDERS: dict[int, StreamFields] = {1: "progressive", 2: "tff", 3: "bff", 4: "bff", 5: "tff"}


class FieldInfo(BaseModel):
    """What a source says and shows of its fields.

    ``stream`` is what the stream declares: its codec parameters' field order, or ``interlaced`` when only the decoded
    frames are flagged so. The ``picture_*`` counts are libavfilter's ``idet`` verdicts over the first
    ``analysed`` frames (its multi-frame counts): combing seen in the pixels, whatever the flags say.
    """

    model_config = ConfigDict(frozen=True)

    stream: StreamFields
    analysed: int
    picture_tff: int = 0
    picture_bff: int = 0
    picture_progressive: int = 0
    picture_undetermined: int = 0

    @property
    def picture_combed(self) -> bool:
        """The pixels show combing: combed frames outnumber progressive ones and are at least a quarter of those
        analysed (still frames show neither, and tell nothing)."""
        combed = self.picture_tff + self.picture_bff
        return combed > self.picture_progressive and 4 * combed >= self.analysed > 0

    @property
    def found_by(self) -> Literal["stream", "picture"] | None:
        """Who says the source is interlaced: the stream's flags first, the picture where the stream declares
        progressive or nothing (progressive-coded combed video is common: captures encoded without interlacing)."""
        if self.stream in ("tff", "bff", "interlaced"):
            return "stream"
        return "picture" if self.picture_combed else None

    @property
    def order(self) -> FieldOrder | None:
        """The field shown first, None for a progressive source. A stream flagged interlaced without an order takes
        the picture's, else top first (what bwdif assumes of unflagged frames)."""
        if self.found_by is None:
            return None
        if self.stream in ("tff", "bff"):
            return self.stream  # type: ignore[return-value]
        return "bff" if self.picture_bff > self.picture_tff else "tff"

    @property
    def picture_disagrees(self) -> bool:
        """The stream declares one field order and the picture clearly shows the other (a mislabelled capture):
        deinterlaced in the declared order, as the stream is believed, but worth a warning."""
        if self.stream not in ("tff", "bff") or not self.picture_combed:
            return False
        shown = "bff" if self.picture_bff > self.picture_tff else "tff"
        return shown != self.stream

    def describe(self) -> str:
        """One line for people: what was found and how."""
        counts = (
            f"{self.picture_tff} top-first, {self.picture_bff} bottom-first, {self.picture_progressive} progressive, "
            f"{self.picture_undetermined} undetermined of {self.analysed} frame(s) analysed"
        )
        if self.order is None:
            return f"progressive (stream: {self.stream}; picture: {counts})"
        first = "top field first" if self.order == "tff" else "bottom field first"
        doubt = "; the picture shows the other order" if self.picture_disagrees else ""
        return f"interlaced, {first}, found by the {self.found_by} (stream: {self.stream}; picture: {counts}){doubt}"


def _stream_fields(stream: av.VideoStream, frames: list[av.VideoFrame]) -> StreamFields:
    declared = _STREAM_ORDERS.get(int(stream.codec_context.field_order or 0), "unknown")
    if declared in ("tff", "bff"):
        return declared
    if any(frame.interlaced_frame for frame in frames):
        return "interlaced"
    return declared


def _pull_all(graph: av.filter.Graph) -> list[av.VideoFrame]:
    pulled = []
    while True:
        try:
            pulled.append(graph.vpull())
        except (av.error.BlockingIOError, av.error.EOFError):
            return pulled


def _graph(stream_or_frame: av.VideoStream | av.VideoFrame, name: str, args: str | None = None) -> av.filter.Graph:
    graph = av.filter.Graph()
    if isinstance(stream_or_frame, av.VideoFrame):
        frame = stream_or_frame
        source = graph.add_buffer(
            width=frame.width, height=frame.height, format=frame.format, time_base=frame.time_base or Fraction(1)
        )
    else:
        source = graph.add_buffer(template=stream_or_frame)
    node = graph.add(name, args)
    sink = graph.add("buffersink")
    source.link_to(node)
    node.link_to(sink)
    graph.configure()
    return graph


def detect_fields(
    container: av.container.InputContainer, stream: av.VideoStream, path: str, frames: int = PICTURE_FRAMES
) -> FieldInfo:
    """Decode the first ``frames`` frames of ``stream`` once: the stream's declared fields and idet's verdicts."""
    decoded: list[av.VideoFrame] = []
    graph: av.filter.Graph | None = None
    verdicts: dict[str, str] = {}
    try:
        for frame in container.decode(stream):
            if graph is None:
                graph = _graph(frame, "idet")
            decoded.append(frame)
            graph.vpush(frame)
            for out in _pull_all(graph):
                verdicts = dict(out.metadata)
            if len(decoded) >= frames:
                break
        if graph is not None:
            graph.vpush(None)
            for out in _pull_all(graph):
                verdicts = dict(out.metadata)
    except av.error.FFmpegError as exc:
        if not decoded:
            raise MediaError(path, f"decoding failed ({exc})") from exc
    counts = {
        verdict: round(float(verdicts.get(f"lavfi.idet.multiple.{verdict}", 0)))
        for verdict in ("tff", "bff", "progressive", "undetermined")
    }
    return FieldInfo(
        stream=_stream_fields(stream, decoded[:1]),
        analysed=len(decoded),
        picture_tff=counts["tff"],
        picture_bff=counts["bff"],
        picture_progressive=counts["progressive"],
        picture_undetermined=counts["undetermined"],
    )


def bwdif_args(order: FieldOrder) -> str:
    """bwdif's options: a frame out per frame in, the given field first, every frame (a source found combed by its
    picture carries no interlaced flags for bwdif's `deint=interlaced` to go by)."""
    return f"mode=send_frame:parity={order}:deint=all"


def deinterlaced(
    frames: Iterable[tuple[K, av.VideoFrame]], order: FieldOrder | None
) -> Iterator[tuple[K, av.VideoFrame]]:
    """``(key, frame)`` pairs with each frame deinterlaced by bwdif, one out per frame in, in order; as they are
    without ``order``.

    bwdif builds frame i from frames i-1, i and i+1, so frame i comes out once frame i+1 went in (or the frames
    ended): a reader that wants frame i equal to a whole-stream decode's feeds frame i-1 before it.
    """
    if order is None:
        yield from frames
        return
    graph: av.filter.Graph | None = None
    keys: deque[K] = deque()
    for key, frame in frames:
        if graph is None:
            graph = _graph(frame, "bwdif", bwdif_args(order))
        keys.append(key)
        graph.vpush(frame)
        for out in _pull_all(graph):
            yield keys.popleft(), out
    if graph is not None:
        graph.vpush(None)
        for out in _pull_all(graph):
            yield keys.popleft(), out


def probe_fields(path: PathLike, frames: int = PICTURE_FRAMES) -> FieldInfo:
    """:func:`detect_fields` of the first video stream of ``path``."""
    path = os.fspath(path)
    with open_input(path) as container:
        stream = video_stream(container, path)
        stream.thread_type = "AUTO"
        return detect_fields(container, stream, path, frames)
