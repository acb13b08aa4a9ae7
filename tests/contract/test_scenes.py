"""Scene-cut windows: cuts found in the decoded source, no window across a cut, a hard cut stays a hard cut."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import procs
import pytest
import scene_set
from media_kit import clip_frames, shot_frames

from entrypoints.console import plan_lines
from k6vsr_core import UpscaleParams, media, upscale
from k6vsr_core.contract.latent import plan_latent
from k6vsr_core.contract.params import parse_params
from k6vsr_core.contract.plan import ModelTraits, make_plan
from k6vsr_core.contract.quality import measure_files
from k6vsr_core.contract.scenes import LAG, find_cuts, source_cuts
from k6vsr_core.contract.windows import (
    WINDOW_FRAMES,
    plan_scene_windows,
    plan_shots,
    plan_windows,
    segment_frames,
    segment_range,
    shares_frames,
    shot_ranges,
)
from k6vsr_core.errors import ParameterError
from k6vsr_core.media.encoding import VideoEncoding
from k6vsr_core.model.bundle import ModelBundle
from service.runs import ModelSpec, RunRef, prepare_run
from storage import RunStore
from storage.manifest import output_params, run_key
from tasks import quality as quality_tasks

SCENES = UpscaleParams(scale=2, windows="scenes")
# --------------------------------------------------------------------------------------------- windows (pure)


@pytest.mark.parametrize(
    ("frames", "cuts"),
    [(300, ()), (300, (40,)), (300, (1, 2, 299)), (700, (100, 130, 400)), (50, (20, 30)), (1000, (121, 242, 600))],
)
@pytest.mark.parametrize("overlap", [0, 16])
def test_no_scene_window_spans_a_cut(frames: int, cuts: tuple[int, ...], overlap: int) -> None:
    windows = plan_scene_windows(frames, overlap, cuts)
    assert [w.index for w in windows] == list(range(len(windows)))
    for window in windows:
        assert not any(window.start < cut < window.stop for cut in cuts)
        # Each window is computed as the trained length, or as a short clip is: padded to 1 + 8k.
        assert window.padded >= window.frames and (window.padded - 1) % 8 == 0 and window.padded <= WINDOW_FRAMES
    # Each shot is windowed exactly as a clip of its length is.
    for start, stop in shot_ranges(frames, cuts):
        inside = [(w.start - start, w.stop - start, w.padded) for w in windows if start <= w.start < stop]
        assert inside == [(w.start, w.stop, w.padded) for w in plan_windows(stop - start, overlap)]
    # The segments still partition the frames, and only windows of one shot share frames.
    ranges = [segment_range(windows, i) for i in range(len(windows))]
    assert ranges[0][0] == 0 and ranges[-1][1] == frames
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:], strict=False))
    assert all(not shares_frames(windows, i) for i, w in enumerate(windows) if w.start in cuts)


def test_each_shot_holds_its_own_windows_and_a_short_one_is_padded() -> None:
    windows = plan_scene_windows(300, 16, (20, 21, 29, 189))
    shots = plan_shots(windows, (20, 21, 29, 189))
    assert [(s.start, s.stop, s.windows) for s in shots] == [
        (0, 20, (0,)), (20, 21, (1,)), (21, 29, (2,)), (29, 189, (3, 4)), (189, 300, (5,))
    ]  # fmt: skip
    assert [windows[s.windows[0]].padded for s in shots if s.frames < WINDOW_FRAMES] == [25, 1, 9, 113]
    with pytest.raises(ValueError, match="do not cover shot"):
        plan_shots(plan_windows(300, 16), (40,))


def test_no_cut_gives_the_even_windows() -> None:
    assert plan_scene_windows(1000, 16, ()) == plan_windows(1000, 16)
    assert plan_scene_windows(50, 16, ()) == plan_windows(50, 16)


@pytest.mark.parametrize("cuts", [(0,), (300,), (50, 40), (40, 40), (-1,)])
def test_cuts_outside_the_clip_or_out_of_order_are_refused(cuts: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="scene cuts"):
        plan_scene_windows(300, 16, cuts)


def test_a_hard_cut_stays_hard_where_even_windows_would_blend_it() -> None:
    """A window's model sees all its frames at once: here each window renders a frame as 4/5 of its shot's value and
    1/5 of the window's mean. A window of one shot renders it exactly; any output frame that is neither shot's value
    holds something of the other shot."""
    frames, cuts = 300, (130,)
    shot_of = np.searchsorted(cuts, np.arange(frames), side="right")
    value = np.array([50, 200])[shot_of]

    def render(start: int, stop: int) -> np.ndarray:
        seen = 0.8 * value[start:stop] + 0.2 * value[start:stop].mean()
        return np.rint(seen)[:, None, None, None].repeat(3, -1).astype(np.uint8)

    def join(windows: tuple) -> np.ndarray:
        renders = [render(w.start, w.stop) for w in windows]
        return np.concatenate(
            [segment_frames(windows, i, renders[i], renders[i - 1] if i else None) for i in range(len(windows))]
        )[:, 0, 0, 0]

    assert np.array_equal(join(plan_scene_windows(frames, 16, cuts)), value)
    blended = join(plan_windows(frames, 16))  # the even windows overlap across frame 130: the cut is cross-faded
    assert not np.isin(blended, (50, 200)).all()


# --------------------------------------------------------------------------------------------- detection


def test_cuts_are_found_where_the_shots_change() -> None:
    frames, cuts = clip_frames([40, 35, 60])
    assert find_cuts(frames) == cuts == (40, 75)


def test_motion_within_one_shot_is_no_cut() -> None:
    assert find_cuts(shot_frames(1, 150)) == ()


@pytest.mark.parametrize("lengths", [[40, 1, 40], [1, 30], [30, 1], [30, 2, 1, 8, 20]])
def test_a_shot_of_one_frame_is_a_shot_anywhere(lengths: list[int]) -> None:
    """No shortest shot: a one-frame shot between two others, first or last, is found (two cuts a frame apart),
    and the last frames, decided with fewer after them, are decided too."""
    frames, cuts = clip_frames(lengths)
    assert find_cuts(frames) == cuts


def test_the_detector_holds_a_few_frames_only() -> None:
    """It reads its frames lazily, deciding each cut a few frames behind the newest: a long source is never held."""
    frames, _ = clip_frames([30, 30])
    read: list[int] = []

    def lazily():
        for i, frame in enumerate(frames):
            read.append(i)
            yield frame

    from k6vsr_core.contract.scenes import _cuts, detection_frame

    found = _cuts(detection_frame(frame) for frame in lazily())
    assert next(found) == 30 and read[-1] == 30 + LAG
    assert list(found) == [] and read[-1] == 59


def test_cuts_in_an_encoded_source_among_its_kept_frames(tmp_path: Path) -> None:
    """From the file, as a run finds them: 30 fps, of which the 24-fps rule keeps 4 in 5."""
    frames, _ = clip_frames([50, 45, 55])
    path = tmp_path / "cuts.mp4"
    media.write_video(path, frames, 30, None)
    kept, _ = media.select_all_frames(len(frames), 30.0)
    found = source_cuts(path, kept)
    # A kept frame starts a shot where the source frame it is starts one (or the first kept after it).
    expected = tuple(int(np.searchsorted(kept, cut)) for cut in (50, 95))
    assert found == expected


def test_the_labelled_set_has_every_kind_of_cut_and_non_cut() -> None:
    clips = scene_set.clips()
    cuts = sum(len(clip.cuts) * len(scene_set.SIZES) for clip in clips)
    kinds = {clip.category for clip in clips}
    assert cuts >= 40 and {f"cut:{k}" for k in ("colour", "luma", "texture", "motion", "all")} <= kinds
    assert {"gradual:fade", "gradual:dissolve", "no-cut:flash", "no-cut:pan"} <= kinds
    gaps = {b - a for clip in clips for a, b in zip(clip.cuts, clip.cuts[1:], strict=False)}
    assert {1, 8, 60} <= gaps
    # The scoring: a cut is found within one frame, each found cut counts once.
    assert scene_set.match((20, 21), (19, 21)) == (2, 0, 0)
    assert scene_set.match((20,), (18, 20, 21)) == (1, 0, 2)


def test_the_detector_meets_its_targets_on_the_labelled_set(tmp_path: Path) -> None:
    """Recall and precision at least 0.95 over the whole set (H.264 CRF 28, two sizes), and every category meets
    them too, so no kind of cut is given up for another."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from scene_accuracy import measure, rates

    totals = measure(tmp_path)
    assert totals["all"][0] + totals["all"][1] >= 40
    for category, counts in totals.items():
        recall, precision = rates(*counts)
        assert recall >= 0.95 and precision >= 0.95, (category, counts)


def test_the_issues_clip_is_planned_with_both_cuts(tmp_path: Path, tiny_bundle_path: Path) -> None:
    """250 frames, two hard cuts between shots that differ in colour and texture: `k6vsr plan --windows scenes`
    finds both, and no window holds frames of two shots."""
    looks = [scene_set.Look(texture=t, seed=s, tint=c) for t, s, c in scene_set.TEXTURES_AND_TINTS]
    shots = tuple(scene_set.Shot(look, n) for look, n in zip(looks, (90, 70, 90), strict=True))
    clip = scene_set.Clip(name="issue", category="cut:issue", shots=shots)
    path = tmp_path / "issue.mp4"
    media.write_video(path, scene_set.render(clip, (128, 192)), 24, None)
    planned = procs.run(
        [sys.executable, "-m", "entrypoints.cli", "plan", str(path), "--scale", "2", "--windows", "scenes",
         "--model", str(tiny_bundle_path), "--store", str(tmp_path / "store"), "--json"],
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr[-2000:]
    plan = json.loads(planned.stdout)
    assert plan["cuts"] == [90, 160]
    assert all(not start < cut < stop for start, stop in (w["frames"] for w in plan["windows"]) for cut in (90, 160))
    # Each shot is shorter than a window: one window of its own, padded as a short clip is, hard cuts between.
    assert [(s["frames"], s["windows"], s["short"], s["computed_as"], s["joined_by"]) for s in plan["shots"]] == [
        ([0, 90], [0], True, 97, None),
        ([90, 160], [1], True, 73, "hard cut"),
        ([160, 250], [2], True, 97, "hard cut"),
    ]
    lines = plan_lines({**plan, "source": "issue.mp4"})
    assert any(
        line.startswith("shots     3, hard cuts between them") and "160-249 (90 frames, as 97)" in line
        for line in lines
    )


# --------------------------------------------------------------------------------------------- the plan and the key


def test_the_plan_lays_scene_windows_by_default_and_even_ones_when_asked() -> None:
    scenes = make_plan((64, 64), 300, 24.0, UpscaleParams(scale=2), ModelTraits(), cuts=(40, 200))
    assert scenes.params.windows == "scenes" and scenes == make_plan((64, 64), 300, 24.0, SCENES, cuts=(40, 200))
    assert scenes.cuts == (40, 200) and [(w.start, w.stop) for w in scenes.windows][:2] == [(0, 40), (40, 161)]
    assert scenes.window_frames == WINDOW_FRAMES and scenes.windows[0].padded == 41 and not scenes.cuts_pending
    even = make_plan((64, 64), 300, 24.0, UpscaleParams(scale=2, windows="even"), ModelTraits(), cuts=(40, 200))
    assert even.cuts == () and even.windows == plan_windows(300, 16)
    # Without cuts, scene windows are the even ones.
    assert make_plan((64, 64), 300, 24.0, SCENES).windows == even.windows
    # The longest window sets the plan's window length: the memory budget plans for it.
    short = make_plan((64, 64), 60, 24.0, SCENES, ModelTraits(), cuts=(20,))
    assert short.window_frames == 41 and short.latent_frames == 11


def test_a_plan_whose_cuts_are_not_looked_for_yet_says_so() -> None:
    pending = make_plan((64, 64), 300, 24.0, SCENES, cuts=None)
    assert pending.cuts_pending and pending.cuts == () and pending.windows == plan_windows(300, 16)
    assert not make_plan((64, 64), 300, 24.0, UpscaleParams(scale=2, windows="even"), cuts=None).cuts_pending


def test_run_keys_of_both_modes_are_those_they_had_before_scenes_became_the_default() -> None:
    """Even windows (the default until 2026-12-06) were keyed without the field, scene windows with it: both keep
    their keys, so a store of either resumes."""
    even, scenes = UpscaleParams(windows="even"), UpscaleParams(windows="scenes")
    assert "windows" not in output_params(even) and output_params(scenes)["windows"] == "scenes"
    assert run_key("0" * 64, even, "model-x") == "20fbd7a9ee979e0540351398"
    assert run_key("0" * 64, scenes, "model-x") == "917d2aab85fbe1850db05788"
    assert run_key("0" * 64, UpscaleParams(), "model-x") == run_key("0" * 64, scenes, "model-x")


def test_a_latent_is_planned_in_even_windows_whatever_was_asked() -> None:
    """A latent has no frames to look for cuts in."""
    for params in (SCENES, UpscaleParams(scale=2, windows="even")):
        plan = plan_latent((31, 16, 8, 8), 24, params, ModelTraits())
        assert plan.params.windows == "even" and plan.windows == plan_windows(121, 16)


# --------------------------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def two_shots(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A lossless two-shot clip (15 + 9 frames) and its second shot alone, so that both decode to the same frames."""
    folder = tmp_path_factory.mktemp("scenes")
    frames, _ = clip_frames([15, 9])
    lossless = VideoEncoding(codec="ffv1")
    both, second = folder / "both.mkv", folder / "second.mkv"
    media.write_video(both, frames, 24, None, encoding=lossless)
    media.write_video(second, frames[15:], 24, None, encoding=lossless)
    return both, second


@pytest.fixture(scope="module")
def scene_run(tiny_bundle: ModelBundle, two_shots: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    """The in-memory runner's scene-window output of the two-shot clip: its file and its frames."""
    out = tmp_path_factory.mktemp("scene-run") / "ref.mp4"
    return out, upscale(two_shots[0], out, tiny_bundle, SCENES, return_frames=True)


def test_each_shot_is_upscaled_as_if_alone(tiny_bundle: ModelBundle, two_shots: tuple[Path, Path], scene_run) -> None:
    """Nothing of one shot reaches the other: the second shot's output frames are exactly those of that shot
    upscaled on its own (the same frames, windows and seeds), so no frame at the cut is blended."""
    _, whole = scene_run
    alone = upscale(two_shots[1], None, tiny_bundle, SCENES, return_frames=True)
    assert whole.plan.cuts == (15,)
    assert [(w.start, w.stop, w.padded) for w in whole.plan.windows] == [(0, 15, 17), (15, 24, 9)]
    assert alone.plan.cuts == () and whole.frames.shape[0] == 24
    assert np.array_equal(whole.frames[15:], alone.frames)


def test_no_output_frame_mixes_two_shots_however_short(tiny_bundle: ModelBundle, tmp_path: Path) -> None:
    """Shots of 9, 1 and 8 frames, each shorter than a window: every shot's output frames are exactly those of the
    shot upscaled on its own, the one-frame shot included, so a hard cut in the source is one in the output."""
    lengths = [9, 1, 8]
    frames, cuts = clip_frames(lengths)
    lossless = VideoEncoding(codec="ffv1")
    whole_path = tmp_path / "three.mkv"
    media.write_video(whole_path, frames, 24, None, encoding=lossless)
    whole = upscale(whole_path, None, tiny_bundle, SCENES, return_frames=True)
    assert whole.plan.cuts == cuts == (9, 10)
    assert [(w.start, w.stop, w.padded) for w in whole.plan.windows] == [(0, 9, 9), (9, 10, 1), (10, 18, 9)]
    for start, stop in shot_ranges(len(frames), cuts):
        alone_path = tmp_path / f"shot-{start}.mkv"
        media.write_video(alone_path, frames[start:stop], 24, None, encoding=lossless)
        alone = upscale(alone_path, None, tiny_bundle, SCENES, return_frames=True)
        assert alone.plan.cuts == ()
        assert np.array_equal(whole.frames[start:stop], alone.frames)


def summary_ref(summary, store: Path) -> RunRef:
    return RunRef(store_root=str(store), run_key=summary.run_key)


def test_the_flow_runs_scene_windows_as_the_runner_does(
    prefect_server: str, tiny_bundle_path: Path, two_shots: tuple[Path, Path], scene_run, tmp_path: Path
) -> None:
    """Windows of two lengths in one run store; `plan` shows the cuts the run uses."""
    from flows.orchestrate import run_clip

    reference, _ = scene_run
    model = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    store = tmp_path / "store"
    summary = run_clip(prepare_run(two_shots[0], SCENES, model, store), str(tmp_path / "flow.mp4"), model).summary()
    assert (tmp_path / "flow.mp4").read_bytes() == reference.read_bytes()
    assert RunStore(store, summary.run_key).read_manifest().plan.cuts == (15,)
    # The run's quality report: measured on the output, kept in the store, found there by the next run.
    quality = summary.quality
    assert quality is not None and quality.frames == 24 and quality.joins == 0 and quality.join_warping_error is None
    assert (store / "runs" / summary.run_key / "quality.json").is_file()
    again = run_clip(prepare_run(two_shots[0], SCENES, model, store), str(tmp_path / "again.mp4"), model).summary()
    assert again.quality == quality and again.reused_output
    # Measured window by window while the run went on, the parts joined give the report of the whole output.
    run_store = RunStore(store, summary.run_key)
    plan = run_store.read_manifest().plan
    whole = measure_files(plan, tmp_path / "flow.mp4", two_shots[0])
    assert quality.model_dump(exclude={"seconds"}) == whole.model_dump(exclude={"seconds"})
    parts = {w: run_store.records.read("quality", str(w)) for w in range(plan.num_windows)}
    assert all(record is not None for record in parts.values())
    assert quality_tasks.measure_window(summary_ref(summary, store), 0, "later").computed is False
    # A report lost is joined again from the parts in the store: none is measured again.
    (store / "runs" / summary.run_key / "quality.json").unlink()
    third = run_clip(prepare_run(two_shots[0], SCENES, model, store), str(tmp_path / "third.mp4"), model).summary()
    assert third.quality.model_dump(exclude={"seconds"}) == quality.model_dump(exclude={"seconds"})
    assert {w: run_store.records.read("quality", str(w)) for w in parts} == parts
    planned = procs.run(
        [sys.executable, "-m", "entrypoints.cli", "plan", str(two_shots[0]), "--scale", "2", "--windows", "scenes",
         "--model", str(tiny_bundle_path), "--store", str(store), "--json"],
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr[-2000:]
    plan = json.loads(planned.stdout)
    assert (plan["window_mode"], plan["cuts"], plan["run_key"]) == ("scenes", [15], summary.run_key)
    assert [w["frames"] for w in plan["windows"]] == [[0, 15], [15, 24]]
    assert plan["windows"][1]["overlap_before"] == 0


def test_the_request_field_and_the_plan_lines_name_the_mode() -> None:
    from entrypoints.console import _cuts
    from entrypoints.server.fields import params_from_fields

    assert params_from_fields({"sr_windows": "scenes"}).windows == "scenes"
    with pytest.raises(ParameterError, match="windows='shots'"):
        parse_params(windows="shots")
    assert _cuts({"window_mode": "even", "cuts": []}) == ""
    assert _cuts({"window_mode": "scenes", "cuts": []}) == ", within shots: no scene cut found"
    assert _cuts({"window_mode": "scenes", "cuts": [40, 75]}) == ", within shots: 2 scene cuts, before frames 40, 75"
    assert _cuts({"window_mode": "scenes", "cuts": list(range(1, 21))}).endswith("11, 12 and 8 more")


def test_an_archive_finds_each_clips_cuts_as_it_ingests_it_not_while_planning_them_all(
    prefect_server: str,
    tiny_bundle_path: Path,
    two_shots: tuple[Path, Path],
    scene_run,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scene windows are the default, and an archive plans every clip before the first computes: looking for cuts
    there would decode every source once more before the GPU starts. The clip's ingest looks for them instead, and
    its output is the scene-window output."""
    import traceback

    from flows.upscale_archive import upscale_archive
    from k6vsr_core.contract import plan as plan_module

    callers: list[list[str]] = []
    found = plan_module.source_cuts

    def counted(*args, **kwargs):
        callers.append([frame.name for frame in traceback.extract_stack()])
        return found(*args, **kwargs)

    monkeypatch.setattr(plan_module, "source_cuts", counted)
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "both.mkv").write_bytes(two_shots[0].read_bytes())
    store = tmp_path / "store"
    summary = upscale_archive(
        input_dir=str(folder),
        output_dir=str(tmp_path / "out"),
        params=UpscaleParams(scale=2),
        model=ModelSpec(model=str(tiny_bundle_path), device="cpu"),
        store_root=str(store),
    )
    (row,) = summary.rows
    assert row.status == "done", row.reason
    assert Path(row.output).read_bytes() == scene_run[0].read_bytes()
    assert RunStore(store, row.run_key).read_manifest().plan.cuts == (15,)
    assert len(callers) == 1 and "read_source" in callers[0] and "plan_clips" not in callers[0]
