"""Variable frame rate: a source's frame times read from its packets, and frames chosen on those times.

Phones and screen recorders write frames when they have them: the durations vary, and the header's average rate
says nothing of where a frame falls. Kept by index at a constant rate, such a clip drifts from its audio by as much
as its rate varies; chosen on their timestamps, output frame k is the source frame shown at k / rate.
"""

from __future__ import annotations

import os
from fractions import Fraction

import av
import numpy as np
from pydantic import BaseModel, ConfigDict

from k6vsr_core.errors import MediaError
from k6vsr_core.media.clock import Timeline
from k6vsr_core.media.probing import PathLike, open_input, video_stream

# Durations that differ by more than this share of the typical one (and more than the time base's rounding) make a
# variable rate; a constant-rate stream's durations differ by a tick at most.
VARIABLE_SPREAD = 0.10
_ROUNDING_TICKS = 2


class FrameTiming(BaseModel):
    """The shape of a source's frame times: constant or variable, and the rates its frame durations span."""

    model_config = ConfigDict(frozen=True)

    variable: bool
    frames: int
    duration_s: float  # first frame's time to the end of the last (its duration taken as the typical one)
    slowest_fps: float
    fastest_fps: float
    mean_fps: float


def frame_times(path: PathLike) -> tuple[np.ndarray, float] | None:
    """Every video frame's presentation time in seconds from the first, in order, from the packets (no decoding),
    and the stream's tick (its time base) in seconds; None when the packets carry no usable times (missing, or
    repeated)."""
    path = os.fspath(path)
    stamps: list[int] = []
    with open_input(path) as container:
        stream = video_stream(container, path)
        time_base = stream.time_base or Fraction(1, 1)
        try:
            for packet in container.demux(stream):
                if packet.size:
                    if packet.pts is None:
                        return None
                    stamps.append(int(packet.pts))
        except av.error.FFmpegError as exc:
            if not stamps:
                raise MediaError(path, f"could not read the video stream ({exc})") from exc
    if not stamps:
        return None
    ticks = np.sort(np.asarray(stamps, dtype=np.int64))
    if np.any(np.diff(ticks) <= 0):
        return None
    return (ticks - ticks[0]).astype(np.float64) * float(time_base), float(time_base)


def timing_of(times: np.ndarray, tick: float) -> FrameTiming:
    """Constant or variable, from the frame durations that ``times`` (seconds, ascending) imply."""
    if len(times) < 2:
        return FrameTiming(variable=False, frames=len(times), duration_s=0.0, slowest_fps=0, fastest_fps=0, mean_fps=0)
    durations = np.diff(times)
    typical = float(np.median(durations))
    spread = float(durations.max() - durations.min())
    variable = spread > max(VARIABLE_SPREAD * typical, _ROUNDING_TICKS * tick)
    duration = float(times[-1]) + typical
    return FrameTiming(
        variable=variable,
        frames=len(times),
        duration_s=duration,
        slowest_fps=1 / float(durations.max()),
        fastest_fps=1 / float(durations.min()),
        mean_fps=len(times) / duration,
    )


def frames_on_times(times: np.ndarray, duration_s: float, rate: int, cap: int | None = None) -> list[int]:
    """The source frame shown at each instant k / ``rate`` of the clip: the one whose time is nearest (the earlier
    on a tie), for ``duration_s * rate`` frames (or the first ``cap``). Output frame k then plays at the instant its
    picture was taken, to within half a source frame, however long the clip: no drift."""
    count = max(1, int(duration_s * rate + 1e-9))
    if cap is not None:
        count = min(count, cap)
    instants = np.arange(count, dtype=np.float64) / rate
    after = np.clip(np.searchsorted(times, instants, side="left"), 0, len(times) - 1)
    before = np.clip(after - 1, 0, len(times) - 1)
    nearer_before = np.abs(instants - times[before]) <= np.abs(times[after] - instants)
    return np.where(nearer_before, before, after).astype(int).tolist()


def timeline_of(times: np.ndarray, tick: float, frames: int) -> Timeline:
    """The first `frames` frames' times (`frame_times`) in the stream's own ticks, ending where the next frame starts
    (the last frame of the stream lasting the typical duration, as `timing_of` takes it)."""
    if not 1 <= frames <= len(times):
        raise ValueError(f"{frames} frame(s) asked of a stream of {len(times)}")
    base = Fraction(tick).limit_denominator(10**9)
    ticks = np.rint(np.asarray(times, dtype=np.float64) / float(base)).astype(np.int64)
    if frames < len(ticks):
        end = int(ticks[frames])
    else:
        end = int(ticks[-1]) + (max(1, int(np.rint(np.median(np.diff(ticks))))) if len(ticks) > 1 else 1)
    return Timeline(time_base=str(base), stamps=(*(int(t) for t in ticks[:frames]), end))
