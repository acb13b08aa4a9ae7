"""Synthetic sources the media tests share, made with PyAV: each test file draws its clips from here rather than
keeping its own copy of a maker."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

MS = Fraction(1, 1000)


def phone_times_ms(count: int, durations_ms: Sequence[int] = (33, 50, 25, 42)) -> list[int]:
    """A phone's frame times: `count` frames at steps cycling through `durations_ms`, never regular."""
    times = [0]
    for index in range(count - 1):
        times.append(times[-1] + durations_ms[index % len(durations_ms)])
    return times


def write_vfr(
    path: Path,
    frames: np.ndarray,
    times_ms: Sequence[int],
    audio_s: float | None = None,
    rotation: int = 0,
    tone_hz: float = 0.0,
) -> Path:
    """H.264 (lossless) in MP4 with each frame at its millisecond time, as a phone writes; `audio_s` seconds of 48 kHz
    stereo (silence, or a `tone_hz` sine) from 0; `rotation` as the display matrix."""
    tick = MS
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "0"}
        stream.codec_context.time_base = stream.time_base = tick
        if rotation:
            stream.set_display_rotation(rotation)
        sound = container.add_stream("aac", rate=48000, layout="stereo") if audio_s else None
        for rgb, at in zip(frames, times_ms, strict=True):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), "rgb24")
            frame.pts, frame.time_base = at, tick
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
        if sound is not None:
            t = np.arange(round(48000 * audio_s)) / 48000
            wave = (0.5 * np.sin(2 * np.pi * tone_hz * t)).astype(np.float32)
            samples = av.AudioFrame.from_ndarray(np.stack([wave, wave]), format="fltp", layout="stereo")
            samples.sample_rate, samples.pts, samples.time_base = 48000, 0, Fraction(1, 48000)
            container.mux(sound.encode(samples))
            container.mux(sound.encode(None))
    return path
