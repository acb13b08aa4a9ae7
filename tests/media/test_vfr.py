"""Variable frame rate: found from the frames' timestamps, resampled on them under `--fps contract` (no drift over
the whole clip), kept frame for frame at their own times under `--fps source`, and said by `k6vsr plan`."""

from __future__ import annotations

import json
import warnings
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from media_kit import clip_frames, phone_times_ms, write_vfr

from entrypoints.cli import main
from k6vsr_core import UpscaleParams, media
from k6vsr_core.contract.plan import make_plan
from k6vsr_core.errors import ParameterError
from k6vsr_core.media.encoding import VideoEncoding
from k6vsr_core.media.sample import make_sample_clip
from k6vsr_core.model.bundle import model_traits
from k6vsr_core.model.runner import read_source, read_window

SIZE = 64
# A phone's pace: frames 25 to 50 ms apart, never regular.
DURATIONS_MS = (33, 50, 25, 42)
FRAMES = 24
GREY_STEP = 8  # frame i is grey 20 + 8 i: which source frame a decoded one is, read from its pixels


def _times_ms(count: int) -> list[int]:
    return phone_times_ms(count, DURATIONS_MS)


def _source_of(decoded: np.ndarray) -> np.ndarray:
    """The source frame index each decoded frame shows, from its grey level."""
    return np.rint((decoded.reshape(len(decoded), -1).mean(axis=1) - 20) / GREY_STEP).astype(int)


@pytest.fixture(scope="module")
def vfr_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """H.264 in MP4 with millisecond timestamps at irregular steps, and a 48 kHz stereo track as long as the video."""
    frames = np.stack([np.full((SIZE, SIZE, 3), 20 + GREY_STEP * index, np.uint8) for index in range(FRAMES)])
    return write_vfr(tmp_path_factory.mktemp("vfr") / "phone.mp4", frames, _times_ms(FRAMES), audio_s=1.0)


def test_a_variable_rate_is_found_from_the_timestamps(vfr_source: Path, tmp_path: Path) -> None:
    times, tick = media.frame_times(vfr_source)
    assert np.allclose(times, np.asarray(_times_ms(FRAMES)) / 1000)
    found = media.timing_of(times, tick)
    assert found.variable and found.slowest_fps == pytest.approx(20) and found.fastest_fps == pytest.approx(40)
    steady = make_sample_clip(
        tmp_path / "steady.mp4", width=SIZE, height=SIZE, num_frames=30, fps=Fraction(30000, 1001)
    )
    assert not media.timing_of(*media.frame_times(steady)).variable


def test_frames_chosen_on_timestamps_do_not_drift_over_ten_minutes() -> None:
    """Ten minutes at 20 to 40 fps: output frame k (played at k / 24) shows the source frame taken nearest that
    instant, within half the longest source frame; kept by index at the mean rate, it would be seconds off."""
    durations = np.random.default_rng(3).uniform(1 / 40, 1 / 20, 20_000)
    times = np.concatenate([[0.0], np.cumsum(durations)[:-1]])
    timing = media.timing_of(times, 1e-6)
    kept = media.frames_on_times(times, timing.duration_s, 24)
    assert len(kept) == int(timing.duration_s * 24)
    error = np.abs(times[kept] - np.arange(len(kept)) / 24)
    assert error.max() <= durations.max() / 2 < 1 / 24
    by_index, _ = media.select_all_frames(len(times), 1.0 / float(np.mean(durations[:100])))
    count = min(len(by_index), len(kept))
    assert np.abs(times[by_index[:count]] - np.arange(count) / 24).max() > 1.0


def test_contract_resamples_on_the_real_timestamps(vfr_source: Path, tiny_bundle) -> None:
    clip = read_source(vfr_source, UpscaleParams(scale=2), model_traits(tiny_bundle.info))
    plan = clip.plan
    times = np.asarray(_times_ms(FRAMES)) / 1000
    duration = times[-1] + float(np.median(np.diff(times)))
    assert plan.fps == 24 and plan.num_frames == int(duration * 24) and plan.kept is not None
    # The frames the model gets, by their pixels: each is the source frame taken nearest its output instant.
    shown = _source_of(read_window(clip, plan.windows[0]))
    assert shown.tolist() == list(plan.kept)
    assert np.abs(times[shown] - np.arange(plan.num_frames) / 24).max() <= max(DURATIONS_MS) / 2000


def test_a_frame_kept_twice_is_read_twice(vfr_source: Path) -> None:
    """Resampled on its timestamps, a slow stretch repeats a source frame: every reader gives it each time."""
    count, stamps = media.scan_frames(vfr_source)
    wanted = [0, 2, 2, 3, 3, 3, 5]
    assert _source_of(media.read_frames(vfr_source, wanted, stamps)).tolist() == wanted
    assert _source_of(media.read_frames(vfr_source, wanted)).tolist() == wanted
    assert _source_of(np.stack(list(media.iter_frames(vfr_source, wanted)))).tolist() == wanted


def test_upscale_writes_the_resampled_clip_in_sync(vfr_source: Path, tiny_bundle_path: Path, tmp_path: Path) -> None:
    argv = ["upscale", str(vfr_source), "--model", str(tiny_bundle_path), "--store", str(tmp_path / "store")]
    argv += ["-o", str(tmp_path / "out"), "--output-file-name", "out.mp4", "--device", "cpu", "--scale", "2"]
    assert main(argv) == 0
    plan = read_source(vfr_source, UpscaleParams(scale=2), model_traits_of(tiny_bundle_path)).plan
    with av.open(str(tmp_path / "out" / "out.mp4")) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        stamps = sorted(float(frame.pts * video.time_base) for frame in container.decode(video))
        sound_s = float(audio.duration * audio.time_base)  # AAC's priming samples are not in it
    assert stamps == pytest.approx([k / 24 for k in range(plan.num_frames)])
    # The contract's audio is cut to the video's length: they end within one frame of each other.
    assert abs(sound_s - plan.num_frames / 24) < 1 / 24


def model_traits_of(bundle: Path):
    from service.runs import ModelSpec, model_info

    return model_traits(model_info(ModelSpec(model=str(bundle), device="cpu"), weights=False))


def test_plan_says_the_rate_varies(vfr_source: Path, tiny_bundle_path: Path, tmp_path: Path, capsys) -> None:
    argv = ["plan", str(vfr_source), "--model", str(tiny_bundle_path), "--store", str(tmp_path), "--scale", "2"]
    assert main([*argv, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["timing"]
    assert shown["variable"] and shown["kept_on_timestamps"] and shown["output_fps"] == 24
    assert main(argv) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("timing"))
    assert "variable frame rate (20 to 40 fps" in line and "chosen on their timestamps at 24 fps" in line


# ------------------------------------------------------------------------------------- --fps source: times kept


def _decoded_times(path: Path) -> tuple[list[Fraction], Fraction | None, Fraction | None]:
    """Every frame's time in display order, the video stream's stated length and the audio's (None: not stated)."""
    with av.open(str(path)) as container:
        video = container.streams.video[0]
        times = sorted(frame.pts * video.time_base for frame in container.decode(video))
        length = video.duration * video.time_base if video.duration else None
        sound = container.streams.audio[0] if container.streams.audio else None
        heard = sound.duration * sound.time_base if sound is not None and sound.duration else None
    return [t - times[0] for t in times], length, heard


def test_source_timing_plans_every_frame_at_its_own_time(vfr_source: Path, tiny_bundle) -> None:
    with pytest.warns(UserWarning, match="keeps every frame at its own time"):
        plan = read_source(vfr_source, UpscaleParams(scale=2, fps_mode="source"), model_traits(tiny_bundle.info)).plan
    times = _times_ms(FRAMES)
    assert plan.num_frames == FRAMES and plan.kept is None
    # Each frame's own millisecond (in the stream's 1/16000 s ticks), the last one lasting the typical step (33 ms).
    assert [stamp * plan.timeline.tick for stamp in plan.timeline.stamps] == [
        Fraction(t, 1000) for t in (*times, times[-1] + 33)
    ]
    assert plan.clock is plan.timeline and plan.frame_timing()["times_kept"]
    assert plan.output_format()["variable_rate"]


def test_plan_says_every_frame_keeps_its_time(vfr_source: Path, tiny_bundle_path: Path, tmp_path: Path, capsys) -> None:
    argv = ["plan", str(vfr_source), "--model", str(tiny_bundle_path), "--store", str(tmp_path), "--scale", "2"]
    assert main([*argv, "--fps", "source"]) == 0
    lines = capsys.readouterr().out.splitlines()
    timing = next(line for line in lines if line.startswith("timing"))
    assert "variable frame rate (20 to 40 fps" in timing and "every frame kept at its own time" in timing
    assert f"{FRAMES} frames at 26.936 fps on average" in next(line for line in lines if line.startswith("output"))


@pytest.fixture(scope="module")
def vfr_shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three shots of 9 frames at a phone's irregular pace, with a second of 440 Hz tone."""
    frames, _ = clip_frames([9, 9, 9])
    return write_vfr(tmp_path_factory.mktemp("vfr") / "shots.mp4", frames, _times_ms(27), audio_s=1.0, tone_hz=440)


def test_upscale_keeps_a_variable_rate_across_joined_segments_in_sync(
    vfr_shots: Path, tiny_bundle_path: Path, tmp_path: Path, capsys
) -> None:
    """Three scene windows, three segments joined: every output frame plays at its source frame's millisecond, the
    stream lasts as the source, and the audio ends with the video (within one frame)."""
    argv = ["upscale", str(vfr_shots), "--model", str(tiny_bundle_path), "--store", str(tmp_path / "store")]
    argv += ["-o", str(tmp_path / "out"), "--output-file-name", "out.mp4", "--device", "cpu", "--scale", "2"]
    assert main([*argv, "--fps", "source", "--windows", "scenes"]) == 0
    out, err = capsys.readouterr()
    assert "keeps every frame at its own time" in err and "fps on average, each frame at its source's time" in out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # said above
        params = UpscaleParams(scale=2, fps_mode="source", windows="scenes")
        plan = read_source(vfr_shots, params, model_traits_of(tiny_bundle_path)).plan
    assert plan.num_windows == 3 and plan.timeline is not None
    times, length, heard = _decoded_times(tmp_path / "out" / "out.mp4")
    assert times == [Fraction(t, 1000) for t in _times_ms(27)]
    assert length == plan.timeline.duration_s
    assert abs(heard - plan.timeline.duration_s) < plan.timeline.shortest_s()


@pytest.mark.parametrize(
    "encoding", [VideoEncoding(), VideoEncoding(codec="ffv1"), VideoEncoding(codec="prores")], ids=lambda e: e.codec
)
def test_joined_segments_keep_a_long_variable_timeline_without_drift(encoding: VideoEncoding, tmp_path: Path) -> None:
    """300 frames 20 to 50 ms apart on a 90 kHz clock, in five segments of uneven length joined: each frame is at
    its planned time (exactly in MP4 and QuickTime, to Matroska's millisecond), the last one lasting as planned,
    and the health check passes."""
    steps = np.random.default_rng(5).integers(1800, 4500, 300)
    timeline = media.Timeline(time_base="1/90000", stamps=(0, *np.cumsum(steps).tolist()))
    frames = np.stack([np.full((64, 64, 3), (i * 7) % 250, np.uint8) for i in range(300)])
    cuts = [0, 17, 121, 122, 200, 300]
    parts = []
    for start, stop in zip(cuts, cuts[1:], strict=False):
        parts.append(str(tmp_path / f"{start}{encoding.suffix}"))
        media.write_segment(parts[-1], frames[start:stop], timeline.part(start, stop), encoding)
    out = tmp_path / f"joined{encoding.suffix}"
    audio = np.zeros(media.AUDIO_SAMPLE_RATE * 12, np.float32)
    media.concat_segments(parts, out, timeline, audio, 300, encoding=encoding)
    media.check_output(out, media.planned_output(encoding, 300, timeline, (64, 64), len(audio)))
    times, length, heard = _decoded_times(out)
    planned = [stamp * timeline.tick for stamp in timeline.stamps[:-1]]
    clock = Fraction(1, 1000) if encoding.container == "matroska" else Fraction(0)
    assert max(abs(seen - want) for seen, want in zip(times, planned, strict=True)) <= clock / 2
    if length is not None:  # Matroska states no stream length
        assert length == timeline.duration_s
        assert abs(heard - timeline.duration_s) < timeline.shortest_s()


def test_the_health_check_refuses_frames_off_their_planned_times(vfr_source: Path, tmp_path: Path) -> None:
    frames = np.zeros((5, 64, 64, 3), np.uint8)
    planned_times = media.Timeline(time_base="1/1000", stamps=(0, 30, 80, 100, 140, 170))
    out = tmp_path / "constant.mp4"
    media.write_video(out, frames, 30, None)  # the same frames at a constant 30 fps
    with pytest.raises(media.OutputMismatch, match=r"frame 1 at 0\.0333 s, 0\.0300 s planned"):
        media.check_output(out, media.planned_output(VideoEncoding(), 5, planned_times, (64, 64)))


def test_matroska_refuses_frames_closer_than_its_millisecond() -> None:
    times = np.array([0.0, 0.0004, 0.04, 0.08, 0.1])  # two frames 0.4 ms apart, a 10 kHz clock
    params = UpscaleParams(scale=2, fps_mode="source", codec="ffv1")
    refused = pytest.raises(ParameterError, match=r"keeps a frame's time to the millisecond.*0\.4 ms apart")
    with refused, pytest.warns(UserWarning, match="its own time"):
        make_plan((64, 64), 5, 25.0, params, frame_times=(times, 1e-4))
    with pytest.warns(UserWarning, match="its own time"):
        kept = make_plan((64, 64), 5, 25.0, params.model_copy(update={"codec": "h264"}), frame_times=(times, 1e-4))
    assert kept.timeline.stamps[:3] == (0, 4, 400)
