"""PyAV's values at the types a call's own arguments promise, where its stubs give a union or an optional.

`add_stream` with a codec named at run time is typed as any stream; a stream's `time_base` as optional, though a
demuxed or muxed stream always has one. Each helper checks what it claims, so a wrong claim fails here, by name.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, TypeVar

import av

S = TypeVar("S", bound=av.stream.Stream)


def stream_as(stream: Any, kind: type[S]) -> S:
    """`stream` as the kind of stream it must be (a video encoder's stream, a source's audio stream)."""
    if not isinstance(stream, kind):
        raise TypeError(f"stream {getattr(stream, 'index', '?')} is a {type(stream).__name__}, not a {kind.__name__}")
    return stream


def time_base(stream: av.stream.Stream) -> Fraction:
    """The stream's time base, which every stream read from or written to a container has."""
    if stream.time_base is None:
        raise ValueError(f"stream {stream.index} has no time base")
    return stream.time_base
