"""A file's audio as the contract's mono 44.1 kHz track: decoded whole, streamed into a file, or cut to a length."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Final

import av
import av.container
import numpy as np

from k6vsr_core.errors import MediaError
from k6vsr_core.media.clock import FrameRate, Timeline, span_s
from k6vsr_core.media.probing import PathLike, open_input

AUDIO_SAMPLE_RATE = 44100
# The contract's audio codec; a re-encoded source stream gets this rate per channel.
AUDIO_CODEC: Final = "aac"
AUDIO_BIT_RATE = 192_000


def _audio_chunks(path: str) -> Iterator[np.ndarray]:
    """The first audio stream as mono float32 pieces at ``AUDIO_SAMPLE_RATE``, clipped to [-1, 1]."""
    with open_input(path) as container:
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


def samples_for(num_frames: int, fps: FrameRate) -> int:
    """Audio samples as long as the first `num_frames` video frames at `fps` (a rate, or the frames' own times)."""
    if isinstance(fps, Timeline):
        return round(span_s(num_frames, fps) * AUDIO_SAMPLE_RATE)
    return round(num_frames / fps * AUDIO_SAMPLE_RATE)


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
    with open_input(path) as container:
        if not container.streams.audio:
            raise MediaError(path, "has no audio stream (given as --audio)")


def write_audio_track(path: PathLike, destination: PathLike, num_frames: int, fps: FrameRate) -> int:
    """Stream the audio of ``path`` as raw mono float32 samples into ``destination``, cut to ``num_frames`` video
    frames at ``fps`` (as :func:`trim_audio`): memory stays one decoded packet whatever the length. Returns the
    number of samples written (0: no audio)."""
    limit = samples_for(num_frames, fps)
    written = 0
    with open(destination, "wb") as handle:
        for chunk in _audio_chunks(os.fspath(path)):
            piece = chunk[: limit - written]
            handle.write(piece.tobytes())
            written += piece.size
            if written >= limit:
                break
    return written


def trim_audio(audio: np.ndarray, num_frames: int, fps: FrameRate) -> np.ndarray:
    """Cut mono audio to the length of ``num_frames`` video frames at ``fps``.

    Audio that is already shorter is returned as is: padding with silence or
    stretching would misrepresent the source.
    """
    if audio.ndim != 1:
        raise ValueError(f"audio must be a 1-D mono array, got shape {audio.shape}")
    if num_frames < 0:
        raise ValueError(f"num_frames must not be negative, got {num_frames}")
    if not isinstance(fps, Timeline) and fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    return audio[: samples_for(num_frames, fps)]
