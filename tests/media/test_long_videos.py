"""Whole videos: every kept frame, in overlapping 121-frame windows, resumable per (window, tile).

The tiny KVAE decodes about 0.1-0.3 megapixels a second here, so the clips are 64x64 (one 128x128 tile at x2): a
121-frame window costs about 20 s.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import av
import numpy as np
import procs
import pytest
import timelines

from k6vsr_core import UpscaleParams, media, upscale
from k6vsr_core.contract.plan import make_plan
from k6vsr_core.contract.windows import WINDOW_FRAMES, crossfade, fade_in, plan_windows, segment_frames, segment_range
from k6vsr_core.media.sample import make_sample_clip
from k6vsr_core.model.bundle import ModelBundle, model_traits
from storage import RunStore

X2 = UpscaleParams(scale=2)


def _clip(folder: Path, frames: int, fps: float) -> Path:
    """The module's clip of `frames` frames at `fps`, written once: tests compare outputs made from it."""
    path = folder / f"c{frames}-{fps:g}.mp4"
    if not path.exists():
        make_sample_clip(path.with_suffix(".part.mp4"), width=64, height=64, num_frames=frames, fps=fps).rename(path)
    return path


def _streams(path: Path) -> tuple[int, float, float, float | None]:
    """(decoded video frames, video fps, video seconds, audio seconds) of a file."""
    with av.open(str(path)) as container:
        video = container.streams.video[0]
        frames = sum(1 for _ in container.decode(video))
        seconds = float(video.duration * video.time_base)
        audio = container.streams.audio[0] if container.streams.audio else None
        audio_s = float(audio.duration * audio.time_base) if audio is not None else None
        return frames, float(video.average_rate), seconds, audio_s


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("long")


# --------------------------------------------------------------------------------------------- windows (pure)


@pytest.mark.parametrize("frames", [1, 5, 120, 121, 122, 130, 241, 250, 1440, 5000])
@pytest.mark.parametrize("overlap", [0, 16, 60])
def test_windows_cover_every_frame_with_the_trained_length(frames: int, overlap: int) -> None:
    windows = plan_windows(frames, overlap)
    assert windows[0].start == 0 and windows[-1].stop == frames
    if frames <= WINDOW_FRAMES:
        assert len(windows) == 1 and windows[0].padded >= frames and (windows[0].padded - 1) % 8 == 0
        return
    assert all(w.frames == w.padded == WINDOW_FRAMES for w in windows)
    for before, after in zip(windows, windows[1:], strict=False):
        assert after.start > before.start and before.stop - after.start >= overlap
    # The fewest windows: one less could not keep the overlap.
    assert (len(windows) - 2) * (WINDOW_FRAMES - overlap) + WINDOW_FRAMES < frames
    # Segments partition the frames in order.
    ranges = [segment_range(windows, i) for i in range(len(windows))]
    assert ranges[0][0] == 0 and ranges[-1][1] == frames
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:], strict=False))


def test_window_overlap_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="window overlap 61"):
        plan_windows(500, 61)
    with pytest.raises(Exception, match="window_overlap=-1"):
        UpscaleParams(window_overlap=-1)


def test_crossfade_ramps_smoothly_from_one_window_to_the_next() -> None:
    ramp = fade_in(16)
    assert np.all(np.diff(ramp) > 0) and 0 < ramp[0] < 0.05 and 0.95 < ramp[-1] < 1
    assert np.allclose(ramp + ramp[::-1], 1.0)  # symmetric: the seam's middle is an even mix
    black, white = np.zeros((16, 2, 2, 3), np.uint8), np.full((16, 2, 2, 3), 255, np.uint8)
    mixed = crossfade(black, white)[:, 0, 0, 0].astype(int)
    assert list(mixed) == sorted(mixed) and mixed[0] < 13 and mixed[-1] > 242
    assert np.array_equal(crossfade(white, white), white)


def test_segments_join_windows_without_losing_or_repeating_a_frame() -> None:
    windows = plan_windows(250, 16)
    # Frame i of the video carries the value i in every window that holds it: a join that skipped or repeated a
    # frame, or mixed two different frames, would show.
    renders = [np.arange(w.start, w.stop, dtype=np.uint8)[:, None, None, None].repeat(3, -1) for w in windows]
    joined = np.concatenate(
        [segment_frames(windows, i, renders[i], renders[i - 1] if i else None) for i in range(len(windows))]
    )
    assert np.array_equal(joined[:, 0, 0, 0], np.arange(250, dtype=np.uint8))


def test_selection_keeps_every_frame_at_the_contract_rate() -> None:
    assert media.select_all_frames(300, 30.0)[1] == 24 and len(media.select_all_frames(300, 30.0)[0]) == 240
    assert media.select_all_frames(250, 25.0) == (list(range(250)), 25)
    assert media.select_all_frames(250, 25.0, max_frames=40) == (list(range(40)), 25)
    # The contract's rule keeps its meaning: the first 121, floored to 1 + 8k.
    assert media.select_frames(300, 30.0)[0] == media.select_all_frames(300, 30.0)[0][:121]
    assert media.select_frames(130, 24.0) == (list(range(121)), 24)
    assert media.select_frames(100, 24.0) == (list(range(97)), 24)


def test_every_window_draws_the_contracts_noise() -> None:
    plan = make_plan((512, 768), 1440, 24.0, UpscaleParams(scale=2))
    contract = make_plan((512, 768), 121, 24.0, UpscaleParams(scale=2, frames="contract"))
    assert plan.num_windows == 14 and plan.num_frames == 1440 and plan.window_frames == 121
    assert [c.seed for c in plan.chunks] == [c.seed for c in contract.chunks] == list(range(42, 51))


# --------------------------------------------------------------------------------------------- the runner


def _in_memory(bundle: ModelBundle, clips: Path, frames: int, fps: float) -> Path:
    """The in-memory runner's output for the module's clip of `frames` at `fps`, made once: tests compare to it."""
    out = clips / f"ref{frames}-{fps:g}.mp4"
    if not out.exists():
        result = upscale(_clip(clips, frames, fps), out.with_suffix(".part.mp4"), bundle, X2)
        assert result.plan.num_frames == frames
        assert result.plan.num_windows == len(plan_windows(frames, X2.window_overlap))
        out.with_suffix(".part.mp4").rename(out)
    return out


@pytest.mark.parametrize("frames", [5, 43, 130])
def test_short_and_odd_lengths_keep_every_frame(tiny_bundle: ModelBundle, clips: Path, frames: int) -> None:
    out = _in_memory(tiny_bundle, clips, frames, 24)
    assert len(plan_windows(frames, X2.window_overlap)) == (2 if frames > WINDOW_FRAMES else 1)
    got, fps, seconds, audio = _streams(out)
    assert (got, fps) == (frames, 24.0)
    assert seconds == pytest.approx(frames / 24) and audio == pytest.approx(frames / 24, abs=0.03)


def test_250_frames_at_25_fps_give_250_frames_and_10_s_of_audio(tiny_bundle: ModelBundle, clips: Path) -> None:
    frames, fps, seconds, audio = _streams(_in_memory(tiny_bundle, clips, 250, 25))
    assert (frames, fps) == (250, 25.0)
    assert seconds == pytest.approx(10.0) and audio == pytest.approx(10.0, abs=0.03)


def test_contract_mode_is_the_single_window_output(tiny_bundle: ModelBundle, clips: Path, tmp_path: Path) -> None:
    """`contract` keeps the first 121 frames of a longer clip in one window; `all` capped at 121 plans the very same
    run but for the mode itself (one plan runs to the same bytes in both modes: the nine-frame test below)."""
    source = _clip(clips, 130, 24)
    contract = upscale(source, tmp_path / "c.mp4", tiny_bundle, UpscaleParams(scale=2, frames="contract"))
    capped = make_plan(
        (64, 64),
        130,
        24.0,
        UpscaleParams(scale=2, max_frames=121),
        model_traits(tiny_bundle.info),
        fields=media.probe_fields(source),
        frame_times=media.frame_times(source),
    )
    assert contract.plan.num_frames == capped.num_frames == 121 and contract.plan.num_windows == 1
    ran, planned = contract.plan.model_dump(), capped.model_dump()
    assert [key for key in ran if ran[key] != planned[key]] == ["params"]
    assert _streams(tmp_path / "c.mp4")[:2] == (121, 24.0)


def test_nine_frames_give_the_same_bytes_in_both_modes(tiny_bundle: ModelBundle, clips: Path, tmp_path: Path) -> None:
    source = _clip(clips, 9, 24)
    upscale(source, tmp_path / "c.mp4", tiny_bundle, UpscaleParams(scale=2, frames="contract"))
    upscale(source, tmp_path / "a.mp4", tiny_bundle, X2)
    assert (tmp_path / "c.mp4").read_bytes() == (tmp_path / "a.mp4").read_bytes()


# --------------------------------------------------------------------------------------------- the command


def _argv(source: Path, out: Path, bundle: Path, store: Path, *extra: str) -> list[str]:
    return [
        "upscale",
        str(source),
        "-o",
        str(out.parent),
        "--output-file-name",
        out.name,
        "--scale",
        "2",
        "--model",
        str(bundle),
        "--store",
        str(store),
        "--json",
        *extra,
    ]


def test_30_fps_source_gives_the_frames_the_selection_keeps(
    prefect_server: str, tiny_bundle_path: Path, clips: Path, tmp_path: Path
) -> None:
    source = _clip(clips, 60, 30)  # 2 s: 48 frames kept at 24 fps, in one short window (a full one costs about 20 s)
    store = tmp_path / "store"
    planned = procs.run(
        [sys.executable, "-m", "entrypoints.cli", "plan", str(source), "--scale", "2", "--model", str(tiny_bundle_path),
         "--store", str(store), "--json"],
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr[-2000:]
    plan = json.loads(planned.stdout)
    done = procs.run(
        [sys.executable, "-m", "entrypoints.cli", *_argv(source, tmp_path / "o.mp4", tiny_bundle_path, store)],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert (summary["frames"], summary["fps"], summary["windows"]) == (48, 24, len(plan_windows(48, 16)))
    frames, fps, seconds, audio = _streams(tmp_path / "o.mp4")
    assert (frames, fps) == (48, 24.0) and seconds == pytest.approx(2.0) and audio == pytest.approx(2.0, abs=0.03)
    # The windows and seeds the run used are the ones `plan` printed.
    manifest = RunStore(store, summary["run_key"]).read_manifest()
    assert [[w.start, w.stop] for w in manifest.plan.windows] == [w["frames"] for w in plan["windows"]]
    assert all(w["seeds"] == manifest.seeds for w in plan["windows"])
    assert plan["frames_kept"] == 48 and plan["run_key"] == summary["run_key"]


def test_kill_mid_window_resumes_the_unfinished_items_with_identical_bytes(
    prefect_server: str, tiny_bundle: ModelBundle, tiny_bundle_path: Path, clips: Path, tmp_path: Path
) -> None:
    """SIGKILL the command once the first of its two windows' tiles is decoded (window 1 is computed beside window
    0's decode, so either may be first); the rerun never recomputes it, finishes the rest, and writes exactly the
    in-memory runner's bytes."""
    reference = _in_memory(tiny_bundle, clips, 130, 24).read_bytes()
    source, store, out = _clip(clips, 130, 24), tmp_path / "store", tmp_path / "out" / "x.mp4"
    argv = _argv(source, out, tiny_bundle_path, store)
    killer = textwrap.dedent(
        f"""
        import os, signal, sys, threading
        import storage.run_store as rs
        plain, lock = rs.RunStore.put_tile, threading.Lock()
        def put_tile(self, name, key, *args, **kwargs):
            with lock:
                plain(self, name, key, *args, **kwargs)
                if name == "tiles":
                    os.kill(os.getpid(), signal.SIGKILL)
        rs.RunStore.put_tile = put_tile
        from entrypoints.cli import main
        sys.exit(main({argv!r}))
        """
    )
    killed = procs.run([sys.executable, "-c", killer])
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not out.exists()
    run = RunStore(store, next((store / "runs").iterdir()).name)
    first = {stage: {i: run.attempt_of(stage, i) for i in run.records.items(stage)} for stage in ("encode", "decode")}
    assert "0" in first["encode"] and len(first["decode"]) == 1

    rerun = procs.run([sys.executable, "-m", "entrypoints.cli", *argv])
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    summary = json.loads(rerun.stdout)
    assert out.read_bytes() == reference
    # One decode was left (window 1's tile is denoised beside window 0's decode, so its denoise may be done too).
    assert summary["tiles_total"] == 2 and summary["items"]["decode"] == {"computed": 1, "reused": 1}
    ran = timelines.spans(run.path, attempt=run.attempt_of("mux"))
    window_1_model = timelines.of_window(ran, ("encode", "denoise", "decode"), 1)
    if window_1_model:
        # Window 0's tile was decoded before the kill: its blend and segment ran beside window 1's model work, not
        # after it (runtime.schedule).
        model_end = max(end for _, end in window_1_model)
        assert all(start < model_end for start, _ in timelines.of_window(ran, ("blend", "segment"), 0))
    else:
        # Window 1's tile was decoded before the kill, so window 1 had no model work left: the rerun decoded window 0.
        assert len(timelines.of_window(ran, ("decode",), 0)) == 1
    assert len(timelines.of_window(ran, ("blend", "segment"), 0)) == 2
    for stage, items in first.items():
        for item, attempt in items.items():
            assert run.attempt_of(stage, item) == attempt, (stage, item)  # finished items were not redone
    # The output, its segments (kept to mux again), the manifest, the audio, the frame index, the records and the
    # run's log and timeline: no window's intermediates are left in the store.
    leftovers = {p.relative_to(run.path).parts[0] for p in run.path.rglob("*") if p.is_file()}
    assert leftovers <= {
        "manifest.json",
        "audio.f32",
        "data.zarr",
        "done",
        "output.mp4",
        "segments",
        "run.log",
        "timeline.jsonl",
        "quality.json",
        "quality",  # each window's part of the report
        ".lock",
    }
    assert sorted(p.name for p in (run.path / "segments").iterdir()) == [f"{w:06d}.mp4" for w in range(2)]
    chunks = [p for p in (run.path / "data.zarr").rglob("*") if p.is_file() and "c" in p.relative_to(run.path).parts]
    assert [p.relative_to(run.path).parts[1] for p in chunks] == ["frame_pts"]


# --------------------------------------------------------------------------------------------- memory


def _long_clip(path: Path, seconds: int) -> Path:
    """A 1280x720 24 fps clip with a stereo tone, encoded fast: a bar sweeping over a flat background."""
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=24, options={"preset": "ultrafast", "crf": "30"})
        video.width, video.height, video.pix_fmt = 1280, 720, "yuv420p"
        sound = container.add_stream("aac", rate=48000, layout="stereo")
        frame = np.full((720, 1280, 3), 90, np.uint8)
        for index in range(seconds * 24):
            frame[:, :, 0] = 90
            frame[:, (index * 7) % 1200 : (index * 7) % 1200 + 80, 0] = 250
            for packet in video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        container.mux(video.encode(None))
        tone = (0.2 * np.sin(np.arange(48000) / 48000 * 2 * np.pi * 440)).astype(np.float32)
        for second in range(seconds):
            samples = av.AudioFrame.from_ndarray(np.stack([tone, tone]), format="fltp", layout="stereo")
            samples.sample_rate, samples.pts = 48000, second * 48000
            container.mux(sound.encode(samples))
        container.mux(sound.encode(None))
    return path


_INGEST_RSS = """
import sys
from k6vsr_core.model.bundle import load_bundle
from service.runs import ModelSpec, prepare_run
from tasks.ingest import ingest
source, bundle, store = sys.argv[1:4]
prepared = prepare_run(source, __import__("k6vsr_core").UpscaleParams(scale=2), ModelSpec(model=bundle), store)
result = ingest.fn(prepared, "rss")
# VmHWM: this program's own peak. ru_maxrss would also count the parent's pages a fork copied before the exec.
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) * 1024
print(result.plan.num_frames, result.plan.num_windows, peak)
"""


def test_ingest_and_plan_memory_does_not_grow_with_length(tiny_bundle_path: Path, tmp_path: Path) -> None:
    """Ingest never holds the frames or the audio: a minute of 720p takes what 10 seconds take."""
    peaks = {}
    for seconds in (10, 60):
        clip = _long_clip(tmp_path / f"{seconds}s.mp4", seconds)
        done = procs.run(
            [sys.executable, "-c", _INGEST_RSS, str(clip), str(tiny_bundle_path), str(tmp_path / "store")],
        )
        assert done.returncode == 0, done.stderr[-2000:]
        frames, windows, peak = (int(v) for v in done.stdout.split())
        assert frames == seconds * 24 and windows == plan_windows(frames, 16).__len__()
        peaks[seconds] = peak
    # One 720p frame is 2.8 MB, a minute of it 4 GB; the audio as float32 mono 11 MB. Neither may show.
    assert peaks[60] - peaks[10] < 16 * 2**20, peaks
    assert peaks[60] < 1.5 * 2**30, peaks
