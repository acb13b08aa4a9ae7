"""Variable frame rate: found from the frames' timestamps, resampled on them under `--fps contract` (no drift over
the whole clip), refused under `--fps source`, and said by `k6vsr plan`."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from entrypoints.cli import main
from k6vsr_core import UpscaleParams, media
from k6vsr_core.bundle import model_traits
from k6vsr_core.runner import read_source, read_window
from k6vsr_core.sample import make_sample_clip

SIZE = 64
# A phone's pace: frames 25 to 50 ms apart, never regular.
DURATIONS_MS = (33, 50, 25, 42)
FRAMES = 24
GREY_STEP = 8  # frame i is grey 20 + 8 i: which source frame a decoded one is, read from its pixels


def _times_ms(count: int) -> list[int]:
    times = [0]
    for index in range(count - 1):
        times.append(times[-1] + DURATIONS_MS[index % len(DURATIONS_MS)])
    return times


def _source_of(decoded: np.ndarray) -> np.ndarray:
    """The source frame index each decoded frame shows, from its grey level."""
    return np.rint((decoded.reshape(len(decoded), -1).mean(axis=1) - 20) / GREY_STEP).astype(int)


@pytest.fixture(scope="module")
def vfr_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """H.264 in MP4 with millisecond timestamps at irregular steps, and a 48 kHz stereo track as long as the video."""
    path = tmp_path_factory.mktemp("vfr") / "phone.mp4"
    tick = Fraction(1, 1000)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width = stream.height = SIZE
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "0"}
        stream.codec_context.time_base = stream.time_base = tick
        sound = container.add_stream("aac", rate=48000, layout="stereo")
        for index, at in enumerate(_times_ms(FRAMES)):
            frame = av.VideoFrame.from_ndarray(np.full((SIZE, SIZE, 3), 20 + GREY_STEP * index, np.uint8), "rgb24")
            frame.pts, frame.time_base = at, tick
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
        samples = av.AudioFrame.from_ndarray(np.zeros((2, 48000), np.float32), format="fltp", layout="stereo")
        samples.sample_rate, samples.pts, samples.time_base = 48000, 0, Fraction(1, 48000)
        container.mux(sound.encode(samples))
        container.mux(sound.encode(None))
    return path


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


def test_source_timing_of_a_variable_rate_is_refused(vfr_source: Path, tiny_bundle_path: Path, tmp_path: Path, capsys):
    out, store = tmp_path / "out", tmp_path / "store"
    argv = ["upscale", str(vfr_source), "--model", str(tiny_bundle_path), "--store", str(store), "-o", str(out)]
    assert main([*argv, "--device", "cpu", "--scale", "2", "--fps", "source"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fps_mode='source'" in err and "rate varies (20 to 40 fps" in err, err
    assert not out.exists() and not store.exists()
