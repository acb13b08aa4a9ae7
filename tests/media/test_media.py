"""Tests for k6vsr_core.media: frame selection rules and PyAV round trips.

All media is generated in tmp directories with PyAV at tiny sizes.
"""

from __future__ import annotations

import os
import pickle
import warnings
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest
from pydantic import ValidationError

from k6vsr_core.errors import MediaError
from k6vsr_core.media import (
    AUDIO_SAMPLE_RATE,
    VideoProbe,
    aligned_frame_count,
    decode_audio,
    probe,
    probing,
    reading,
    select_frames,
    trim_audio,
    write_video,
    writing,
)

# --------------------------------------------------------------------------- #
# Fixture helpers
# --------------------------------------------------------------------------- #


def frame_value(index: int) -> int:
    """Grey level that identifies frame ``index`` after decoding."""
    return (index * 8) % 256


def make_video(
    path: Path,
    *,
    num_frames: int,
    fps: int | Fraction = 24,
    width: int = 64,
    height: int = 48,
    codec: str = "libx264",
    pix_fmt: str = "yuv420p",
    tone_hz: float | None = None,
    audio_rate: int = 48000,
    rotation: int | None = None,
) -> Path:
    """Write a clip whose frame i is a flat grey of frame_value(i)."""
    with av.open(str(path), mode="w") as container:
        video = container.add_stream(codec, rate=fps)
        video.width, video.height, video.pix_fmt = width, height, pix_fmt
        if rotation is not None:
            video.set_display_rotation(rotation)
        audio = None
        if tone_hz is not None:
            audio = container.add_stream("aac", rate=audio_rate, layout="stereo")
        for i in range(num_frames):
            rgb = np.full((height, width, 3), frame_value(i), dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = i
            container.mux(video.encode(frame))
        container.mux(video.encode(None))
        if audio is not None:
            n = round(num_frames / float(fps) * audio_rate)
            t = np.arange(n) / audio_rate
            tone = (0.5 * np.sin(2 * np.pi * tone_hz * t)).astype(np.float32)
            samples = av.AudioFrame.from_ndarray(np.stack([tone, tone]), format="fltp", layout="stereo")
            samples.sample_rate = audio_rate
            samples.pts = 0
            container.mux(audio.encode(samples))
            container.mux(audio.encode(None))
    return path


def make_lossless(path: Path, *, num_frames: int, fps: int = 24, width: int = 32, height: int = 16) -> Path:
    """FFV1 RGB in Matroska: exact grey levels, odd sizes allowed, no stored frame count."""
    return make_video(path, num_frames=num_frames, fps=fps, width=width, height=height, codec="ffv1", pix_fmt="bgr0")


def make_audio_only(path: Path) -> Path:
    with av.open(str(path), mode="w") as container:
        audio = container.add_stream("aac", rate=44100, layout="mono")
        samples = av.AudioFrame.from_ndarray(np.zeros((1, 4410), np.float32), format="fltp", layout="mono")
        samples.sample_rate = 44100
        samples.pts = 0
        container.mux(audio.encode(samples))
        container.mux(audio.encode(None))
    return path


def grey_levels(frames: np.ndarray) -> list[int]:
    return [int(round(float(f.mean()))) for f in frames]


@pytest.fixture(scope="module")
def av_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """9 frames, 64x48, 24 fps H.264 with a 440 Hz stereo 48 kHz tone."""
    return make_video(tmp_path_factory.mktemp("av") / "clip.mp4", num_frames=9, tone_hz=440.0)


@pytest.fixture(scope="module")
def silent_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_video(tmp_path_factory.mktemp("silent") / "silent.mp4", num_frames=9)


# --------------------------------------------------------------------------- #
# select_frames / aligned_frame_count
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("num_frames", "expected"),
    [(1, 1), (8, 1), (9, 9), (10, 9), (16, 9), (17, 17), (121, 121), (128, 121), (129, 129)],
)
def test_aligned_frame_count(num_frames: int, expected: int) -> None:
    assert aligned_frame_count(num_frames) == expected


def test_aligned_frame_count_rejects_zero() -> None:
    with pytest.raises(ValueError):
        aligned_frame_count(0)


def test_select_ntsc_film_keeps_all_frames_at_24() -> None:
    assert select_frames(30, 24000 / 1001) == (list(range(25)), 24)


def test_select_25fps_keeps_all_frames_at_25() -> None:
    assert select_frames(17, 25.0) == (list(range(17)), 25)


def test_select_30fps_strides_by_1_25() -> None:
    # round(i * 1.25) for i < 32, half-to-even (12.5 -> 12, 22.5 -> 22), first 25.
    expected = [0, 1, 2, 4, 5, 6, 8, 9, 10, 11, 12, 14, 15, 16, 18, 19, 20, 21, 22, 24, 25, 26, 28, 29, 30]
    assert select_frames(40, 30.0) == (expected, 24)


def test_select_50fps_strides_by_50_over_24() -> None:
    expected = [0, 2, 4, 6, 8, 10, 12, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33]
    assert select_frames(40, 50.0) == (expected, 24)


def test_select_60fps_strides_by_2_5() -> None:
    assert select_frames(30, 60.0) == ([0, 2, 5, 8, 10, 12, 15, 18, 20], 24)


def test_select_low_fps_keeps_all_frames_and_warns() -> None:
    with pytest.warns(UserWarning, match="no motion interpolation"):
        assert select_frames(20, 12.0) == (list(range(17)), 12)


def test_select_near_24_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        select_frames(9, 24.0)
        select_frames(9, 25.0)


def test_select_tolerance_boundaries() -> None:
    # |22.5 - 24| == 1.5 is outside the tolerance: native rate, with a warning.
    with pytest.warns(UserWarning):
        assert select_frames(9, 22.5)[1] == 22
    # 25.5 is outside too, on the fast side: strided to 24 fps.
    indices, fps = select_frames(40, 25.5)
    assert fps == 24
    # int(40 / 1.0625) = 37 candidates, floored to 33 (i = 0..32); round(32 * 1.0625) = 34.
    assert len(indices) == 33
    assert indices[:4] == [0, 1, 2, 3] and indices[-1] == 34


def test_select_caps_at_121_frames() -> None:
    assert select_frames(300, 24.0) == (list(range(121)), 24)


def test_select_caps_strided_selection_at_121_frames() -> None:
    indices, fps = select_frames(1000, 60.0)
    assert fps == 24
    assert len(indices) == 121
    assert indices[:5] == [0, 2, 5, 8, 10]
    assert indices[-1] == 300  # round(120 * 2.5)


@pytest.mark.parametrize(("num_frames", "expected"), [(10, list(range(9))), (8, [0]), (1, [0])])
def test_select_floors_to_one_plus_eight_k(num_frames: int, expected: list[int]) -> None:
    assert select_frames(num_frames, 24.0) == (expected, 24)


@pytest.mark.parametrize(("num_frames", "fps"), [(0, 24.0), (1, 60.0), (10, 0.0), (10, -5.0), (10, float("nan"))])
def test_select_rejects_empty_or_invalid(num_frames: int, fps: float) -> None:
    with pytest.raises(ValueError):
        select_frames(num_frames, fps)


# --------------------------------------------------------------------------- #
# probe
# --------------------------------------------------------------------------- #


def test_probe_reads_av_clip(av_clip: Path) -> None:
    info = probe(av_clip)
    assert isinstance(info, VideoProbe)
    assert info.path == str(av_clip)
    assert (info.width, info.height) == (64, 48)
    assert info.num_frames == 9
    assert info.fps == pytest.approx(24.0)
    assert info.has_audio is True
    assert info.codec == "h264"
    assert info.pix_fmt == "yuv420p"
    assert info.rotation == 0
    assert info.duration_s == pytest.approx(9 / 24, abs=0.05)
    with pytest.raises(ValidationError, match="frozen"):
        info.width = 1


def test_probe_counts_frames_when_container_has_no_count(tmp_path: Path) -> None:
    # Matroska stores no frame count, so stream.frames is 0 and packets are counted.
    clip = make_lossless(tmp_path / "clip.mkv", num_frames=11)
    with av.open(str(clip)) as container:
        assert container.streams.video[0].frames == 0
    info = probe(clip)
    assert info.num_frames == 11
    assert info.has_audio is False


def test_probe_reads_display_rotation(tmp_path: Path) -> None:
    clip = make_video(tmp_path / "rotated.mp4", num_frames=3, rotation=90)
    assert probe(clip).rotation == 90


def make_directory(tmp_path: Path) -> Path:
    path = tmp_path / "folder.mp4"
    path.mkdir()
    return path


def make_empty(tmp_path: Path) -> Path:
    path = tmp_path / "empty.mp4"
    path.touch()
    return path


def make_garbage(tmp_path: Path) -> Path:
    path = tmp_path / "garbage.mp4"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    return path


@pytest.mark.parametrize(
    ("make", "cause"),
    [
        (lambda tmp: tmp / "missing.mp4", "no such file"),
        (make_directory, "is a directory"),
        (make_empty, "empty file"),
        (make_garbage, "not a readable media file"),
        (lambda tmp: make_audio_only(tmp / "sound.m4a"), "no video stream"),
    ],
    ids=["missing", "directory", "empty", "garbage", "audio-only"],
)
def test_probe_errors_name_path_and_cause(tmp_path: Path, make, cause: str) -> None:
    path = make(tmp_path)
    with pytest.raises(MediaError) as info:
        probe(path)
    assert str(path) in str(info.value)
    assert cause in str(info.value)
    assert info.value.path == str(path)
    assert cause in info.value.cause


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root can read any file")
def test_probe_unreadable_file(av_clip: Path, tmp_path: Path) -> None:
    path = tmp_path / "locked.mp4"
    path.write_bytes(av_clip.read_bytes())
    path.chmod(0)
    with pytest.raises(MediaError, match="permission denied"):
        probe(path)


def test_media_error_is_value_error_and_pickles() -> None:
    err = MediaError("/x/y.mp4", "no such file")
    assert isinstance(err, ValueError)
    assert str(err) == "/x/y.mp4: no such file"
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.path, copy.cause, str(copy)) == (err.path, err.cause, str(err))


@pytest.mark.parametrize(
    ("rates", "cause"),
    [
        ((None, None), "unknown"),
        ((Fraction(0), Fraction(-1)), "not positive"),
        ((Fraction(90000), None), "implausible"),
    ],
)
def test_source_fps_rejects_unusable_rates(rates: tuple, cause: str) -> None:
    stream = SimpleNamespace(average_rate=rates[0], base_rate=rates[1])
    with pytest.raises(MediaError, match=cause) as info:
        probing._source_rate(stream, "/in.mp4")
    assert "frame rate" in str(info.value) and "/in.mp4" in str(info.value)


# --------------------------------------------------------------------------- #
# Reading a source as a run does: scanned, planned on the contract's frames, read
# --------------------------------------------------------------------------- #


def read_kept(path: Path) -> tuple[np.ndarray, int]:
    """The frames a run keeps of `path` under the contract's selection, and their rate: `read_source` scans and plans
    the file, `read_frames` reads the planned frames."""
    from k6vsr_core import media
    from k6vsr_core.contract.params import parse_params
    from k6vsr_core.contract.plan import ModelTraits
    from k6vsr_core.contract.source import read_source

    clip = read_source(path, parse_params(scale=2, frames="contract"), ModelTraits())
    return media.read_frames(path, clip.plan.source_indices(), clip.frame_pts), clip.plan.fps


def lying_probe(monkeypatch: pytest.MonkeyPatch, clip: Path, num_frames: int) -> None:
    """Make the probe of `clip` claim `num_frames` frames, as a damaged header does."""
    from k6vsr_core import media

    lying = probe(clip).model_copy(update={"num_frames": num_frames})
    monkeypatch.setattr(media, "probe", lambda path: lying)


def test_read_av_clip(av_clip: Path) -> None:
    frames, fps = read_kept(av_clip)
    assert frames.shape == (9, 48, 64, 3)
    assert frames.dtype == np.uint8
    assert fps == 24
    assert grey_levels(frames) == pytest.approx([frame_value(i) for i in range(9)], abs=2)


def test_read_60fps_keeps_only_selected_indices(tmp_path: Path) -> None:
    clip = make_lossless(tmp_path / "fast.mkv", num_frames=30, fps=60)
    frames, fps = read_kept(clip)
    assert fps == 24
    assert grey_levels(frames) == [frame_value(i) for i in [0, 2, 5, 8, 10, 12, 15, 18, 20]]


def test_decoding_stops_after_last_kept_frame(tmp_path: Path) -> None:
    clip = make_lossless(tmp_path / "long.mkv", num_frames=40)
    kept, decoded = reading._decode_indices(str(clip), [0, 2, 5])
    assert sorted(kept) == [0, 2, 5]
    assert decoded == 6


def test_read_25fps_keeps_every_frame(tmp_path: Path) -> None:
    clip = make_video(tmp_path / "pal.mp4", num_frames=9, fps=25)
    frames, fps = read_kept(clip)
    assert (frames.shape[0], fps) == (9, 25)


def test_read_odd_size(tmp_path: Path) -> None:
    clip = make_lossless(tmp_path / "odd.mkv", num_frames=9, width=257, height=161)
    info = probe(clip)
    assert (info.width, info.height, info.num_frames) == (257, 161, 9)
    frames, fps = read_kept(clip)
    assert frames.shape == (9, 161, 257, 3)
    assert grey_levels(frames) == [frame_value(i) for i in range(9)]


@pytest.mark.parametrize(
    ("name", "codec", "pix_fmt"),
    [("alpha.mov", "png", "rgba"), ("deep.mkv", "ffv1", "yuv420p10le")],
)
def test_read_converts_any_pix_fmt_to_rgb(tmp_path: Path, name: str, codec: str, pix_fmt: str) -> None:
    clip = make_video(tmp_path / name, num_frames=9, codec=codec, pix_fmt=pix_fmt)
    assert probe(clip).pix_fmt == pix_fmt
    frames, _ = read_kept(clip)
    assert frames.shape == (9, 48, 64, 3) and frames.dtype == np.uint8
    assert grey_levels(frames) == pytest.approx([frame_value(i) for i in range(9)], abs=2)


def test_read_recovers_when_metadata_overstates_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clip = make_lossless(tmp_path / "short.mkv", num_frames=12)
    lying_probe(monkeypatch, clip, 40)
    with pytest.warns(UserWarning, match=r"only 12 of 40 frame\(s\) could be decoded"):
        frames, fps = read_kept(clip)
    assert (frames.shape[0], fps) == (9, 24)
    assert grey_levels(frames) == [frame_value(i) for i in range(9)]


def test_read_recovers_strided_selection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clip = make_lossless(tmp_path / "fast.mkv", num_frames=30, fps=60)
    lying_probe(monkeypatch, clip, 100)
    with pytest.warns(UserWarning, match="could be decoded"):
        frames, fps = read_kept(clip)
    assert fps == 24
    assert grey_levels(frames) == [frame_value(i) for i in [0, 2, 5, 8, 10, 12, 15, 18, 20]]


def test_too_short_for_stride_is_media_error(tmp_path: Path) -> None:
    clip = make_lossless(tmp_path / "blip.mkv", num_frames=2, fps=60)
    with pytest.raises(MediaError, match="no frames kept") as info:
        read_kept(clip)
    assert str(clip) in str(info.value)


# --------------------------------------------------------------------------- #
# Audio
# --------------------------------------------------------------------------- #


def test_decode_audio_is_mono_44k_tone(av_clip: Path) -> None:
    audio = decode_audio(av_clip)
    assert audio is not None
    assert audio.ndim == 1 and audio.dtype == np.float32
    # AAC works in 1024-sample blocks, so the decoded length overshoots a little.
    assert abs(audio.size - 9 / 24 * AUDIO_SAMPLE_RATE) <= 2048
    # Every source sample survives resampling, including the resampler's tail.
    with av.open(str(av_clip)) as container:
        source_samples = sum(frame.samples for frame in container.decode(audio=0))
    assert abs(audio.size - source_samples * AUDIO_SAMPLE_RATE / 48000) <= 2
    assert float(np.abs(audio).max()) <= 1.0
    spectrum = np.abs(np.fft.rfft(audio))
    peak_hz = np.argmax(spectrum) * AUDIO_SAMPLE_RATE / audio.size
    assert peak_hz == pytest.approx(440, abs=5)


def test_decode_audio_none_without_audio_stream(silent_clip: Path) -> None:
    assert decode_audio(silent_clip) is None


def test_decode_audio_missing_file_is_media_error(tmp_path: Path) -> None:
    with pytest.raises(MediaError, match="no such file"):
        decode_audio(tmp_path / "nope.mp4")


def test_trim_audio_cuts_to_video_length() -> None:
    audio = np.arange(50_000, dtype=np.float32)
    trimmed = trim_audio(audio, 10, 24)
    assert trimmed.size == 18375  # round(10 / 24 * 44100)
    assert np.array_equal(trimmed, audio[:18375])


def test_trim_audio_rounds_to_nearest_sample() -> None:
    assert trim_audio(np.zeros(50_000, np.float32), 2, 13).size == 6785  # 2 / 13 * 44100 = 6784.6


def test_trim_audio_keeps_shorter_audio_as_is() -> None:
    audio = np.ones(100, dtype=np.float32)
    assert np.array_equal(trim_audio(audio, 10, 24), audio)


# --------------------------------------------------------------------------- #
# write_video
# --------------------------------------------------------------------------- #


def test_round_trip_with_audio(av_clip: Path, tmp_path: Path) -> None:
    frames, fps = read_kept(av_clip)
    audio = decode_audio(av_clip)
    out = tmp_path / "out.mp4"
    write_video(out, frames, fps, audio)

    with av.open(str(out)) as container:
        video = container.streams.video[0]
        assert video.codec_context.name == "h264"
        assert video.codec_context.pix_fmt == "yuv420p"
        assert (video.codec_context.width, video.codec_context.height) == (64, 48)
        assert float(video.average_rate) == pytest.approx(24)
        assert sum(1 for _ in container.decode(video)) == 9
    with av.open(str(out)) as container:
        sound = container.streams.audio[0]
        assert sound.codec_context.name == "aac"
        assert sound.codec_context.sample_rate == 44100
        assert sound.codec_context.layout.nb_channels == 1
        assert float(sound.duration * sound.time_base) == pytest.approx(9 / 24, abs=0.01)

    again, again_fps = read_kept(out)
    assert (again.shape, again_fps) == (frames.shape, 24)
    assert np.abs(again.astype(int) - frames.astype(int)).mean() < 3


def test_round_trip_keeps_colours(tmp_path: Path) -> None:
    colours = np.array([[230, 40, 40], [40, 200, 60], [30, 60, 220], [240, 240, 240]], dtype=np.uint8)
    frame = np.repeat(np.repeat(colours.reshape(2, 2, 3), 24, axis=0), 32, axis=1)
    out = tmp_path / "colours.mp4"
    write_video(out, np.stack([frame] * 9), 24, None)
    decoded, _ = read_kept(out)
    centres = decoded[4][[12, 12, 36, 36], [16, 48, 16, 48]].astype(int)
    assert np.abs(centres - colours.astype(int)).max() <= 6


def test_silent_source_gives_video_only_output(silent_clip: Path, tmp_path: Path) -> None:
    frames, fps = read_kept(silent_clip)
    out = tmp_path / "out.mp4"
    write_video(out, frames, fps, decode_audio(silent_clip))
    with av.open(str(out)) as container:
        assert len(container.streams.video) == 1
        assert len(container.streams.audio) == 0
    assert probe(out).has_audio is False


def test_write_video_is_byte_identical(av_clip: Path, tmp_path: Path) -> None:
    frames, fps = read_kept(av_clip)
    audio = decode_audio(av_clip)
    write_video(tmp_path / "a.mp4", frames, fps, audio)
    write_video(tmp_path / "b.mp4", frames, fps, audio)
    assert (tmp_path / "a.mp4").read_bytes() == (tmp_path / "b.mp4").read_bytes()


def test_write_video_pads_odd_size_by_edge_replication(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    frames = np.repeat(rng.integers(0, 256, (1, 47, 63, 3), dtype=np.uint8), 9, axis=0)
    frames[:, :, -8:] = 200  # flat right edge so the padded column is easy to check
    out = tmp_path / "odd.mp4"
    write_video(out, frames, 24, None)
    info = probe(out)
    assert (info.width, info.height) == (64, 48)
    decoded, _ = read_kept(out)
    assert abs(float(decoded[:, :40, -1].mean()) - 200) < 4


def test_odd_sizes_are_padded_by_replicating_the_edge() -> None:
    rng = np.random.default_rng(2)
    frames = rng.integers(0, 256, (2, 5, 7, 3), dtype=np.uint8)
    for frame in writing._encoder_frames(frames, 24):
        assert (frame.width, frame.height, frame.format.name) == (8, 6, "yuv420p")
        # A replicated column/row shares its chroma block with its source, so
        # it converts back to exactly the same RGB; scaling would blend it.
        rgb = frame.to_ndarray(format="rgb24")
        assert np.array_equal(rgb[:, 7], rgb[:, 6])
        assert np.array_equal(rgb[5], rgb[4])


def test_write_video_removes_partial_file_on_failure(
    av_clip: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "broken.mp4"
    existed_when_failing: list[bool] = []

    class ExplodingAudioFrame:
        @staticmethod
        def from_ndarray(*args, **kwargs):
            # Video is fully muxed by now, so a partial file is on disk.
            existed_when_failing.append(out.exists())
            raise RuntimeError("encoder exploded")

    monkeypatch.setattr(av, "AudioFrame", ExplodingAudioFrame)
    frames, fps = read_kept(av_clip)
    with pytest.raises(MediaError, match="encoder exploded") as info:
        write_video(out, frames, fps, np.zeros(AUDIO_SAMPLE_RATE, np.float32))
    assert existed_when_failing == [True]
    assert str(out) in str(info.value)
    assert not out.exists()


def test_write_video_into_missing_directory_is_media_error(tmp_path: Path) -> None:
    out = tmp_path / "nowhere" / "out.mp4"
    with pytest.raises(MediaError) as info:
        write_video(out, np.zeros((1, 48, 64, 3), np.uint8), 24, None)
    assert str(out) in str(info.value)


@pytest.mark.parametrize(
    "frames",
    [
        np.zeros((48, 64, 3), np.uint8),
        np.zeros((1, 48, 64, 4), np.uint8),
        np.zeros((1, 48, 64, 3), np.float32),
        np.zeros((0, 48, 64, 3), np.uint8),
    ],
    ids=["ndim3", "rgba", "float", "empty"],
)
def test_write_video_validates_frames(tmp_path: Path, frames: np.ndarray) -> None:
    out = tmp_path / "out.mp4"
    with pytest.raises(ValueError, match="frames"):
        write_video(out, frames, 24, None)
    assert not out.exists()


def test_write_video_validates_fps(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fps"):
        write_video(tmp_path / "out.mp4", np.zeros((1, 48, 64, 3), np.uint8), 0, None)
