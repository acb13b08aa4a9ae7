"""A synthetic sample clip: moving shapes and a tone, for the demo and the tests where no real footage exists."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from k6vsr_core.media.encoding import VideoEncoding


def sample_frames(width: int, height: int, num_frames: int) -> np.ndarray:
    """(T, H, W, 3) uint8: a gradient background with a bright disc and a bar that move across the frame."""
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    for t in range(num_frames):
        phase = t / max(1, num_frames - 1)
        cx, cy = width * (0.2 + 0.6 * phase), height * 0.5
        disc = ((xs - cx) ** 2 + (ys - cy) ** 2) < (min(width, height) * 0.18) ** 2
        bar = np.abs(xs - width * (0.8 - 0.6 * phase)) < max(2, width // 24)
        frame = np.stack([xs / max(1, width - 1) * 160, ys / max(1, height - 1) * 160, np.full_like(xs, 60)], -1)
        frame[disc] = (240, 220, 40)
        frame[bar] = (30, 90, 230)
        frames[t] = frame.astype(np.uint8)
    return frames


def make_sample_clip(
    path: str | Path,
    *,
    width: int = 128,
    height: int = 128,
    num_frames: int = 9,
    fps: int | float | Fraction = 24,
    audio: bool = True,
    tone_hz: float = 440.0,
    sample_rate: int = 48000,
) -> Path:
    """Write an H.264 (yuv420p) MP4 with an optional stereo tone; sizes must be even."""
    path = Path(path)
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=rate)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        options: dict[str, object] = dict(VideoEncoding().options())  # the contract's H.264, the same bytes every run
        video.options = options
        sound = None
        if audio:
            sound = container.add_stream("aac", rate=sample_rate, layout="stereo")
        for image in sample_frames(width, height, num_frames):
            for packet in video.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        if sound is not None:
            seconds = num_frames / float(rate)
            t = np.arange(int(seconds * sample_rate)) / sample_rate
            tone = (0.3 * np.sin(2 * np.pi * tone_hz * t)).astype(np.float32)
            frame = av.AudioFrame.from_ndarray(np.stack([tone, tone]), format="fltp", layout="stereo")
            frame.sample_rate = sample_rate
            frame.pts = 0
            for packet in sound.encode(frame):
                container.mux(packet)
            for packet in sound.encode():
                container.mux(packet)
    return path
