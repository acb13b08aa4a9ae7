"""The quality report: each measure on synthetic outputs whose answer is known.

The ground truth is a smooth moving pattern drawn at the output's size; the source is it scaled down (area), so an
ideal upscaler is one that gives the ground truth back. Each defect is injected into that ideal output.
"""

from __future__ import annotations

import numpy as np
import pytest

from k6vsr_core import UpscaleParams
from k6vsr_core.contract.plan import ModelTraits, make_plan
from k6vsr_core.contract.quality import QualityMeter, join_pairs, measure, tile_borders
from k6vsr_core.contract.windows import plan_scene_windows, plan_windows, segment_frames

FRAMES = 250
PLAN = make_plan((32, 48), FRAMES, 24.0, UpscaleParams(scale=2), ModelTraits())
BORDERS = ([32], [40, 56])  # rows and columns of a hypothetical tile grid of the 64x96 output


def pattern(frames: int, height: int, width: int, scale: float, start: int = 0) -> np.ndarray:
    """A smooth coloured pattern panning right, drawn at `scale` times the source's pixel grid."""
    y, x = np.mgrid[0:height, 0:width] / scale
    out = []
    for t in range(start, start + frames):
        red = np.sin((x + 0.7 * t) / 5.0) * 0.4 + 0.5
        green = np.cos((y - 0.3 * t) / 7.0) * 0.3 + 0.5
        blue = np.sin((x + y + t) / 9.0) * 0.3 + 0.45
        out.append(np.stack([red, green, blue], -1))
    return np.clip(np.rint(np.stack(out) * 255), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def truth() -> tuple[np.ndarray, np.ndarray]:
    """(ideal output at 64x96, its source at 32x48: the ideal output averaged over 2x2 blocks)."""
    ideal = pattern(FRAMES, 64, 96, 2.0)
    source = ideal.reshape(FRAMES, 32, 2, 48, 2, 3).mean(axis=(2, 4)).round().astype(np.uint8)
    return ideal, source


def meter_report(outputs: np.ndarray, sources: np.ndarray, windows=PLAN.windows, cuts=(), borders=BORDERS):
    meter = QualityMeter(windows, cuts, borders)
    for output, source in zip(outputs, sources, strict=True):
        meter.add(output, source)
    return meter.report()


def per_window(ideal: np.ndarray, windows, change) -> np.ndarray:
    """The output the flow writes when window `w` renders its frames as `change(w, frames)`: cross-faded joins."""
    renders = [change(w.index, ideal[w.start : w.stop]) for w in windows]
    return np.concatenate(
        [segment_frames(windows, i, renders[i], renders[i - 1] if i else None) for i in range(len(windows))]
    )


def brighter(window: int, frames: np.ndarray) -> np.ndarray:
    """Every other window 12 levels brighter: what two windows disagreeing on exposure look like."""
    return np.clip(frames.astype(np.int16) + 12 * (window % 2), 0, 255).astype(np.uint8)


def test_an_ideal_upscaler_scores_clean(truth) -> None:
    ideal, source = truth
    report = meter_report(ideal, source)
    assert report.findings == []
    assert report.joins == 2 and report.frames == FRAMES and report.tile_borders == 3
    assert 0.7 < report.join_difference_energy.ratio < 1.3 and 0.7 < report.join_warping_error.ratio < 1.3
    assert report.tile_seam_energy.ratio < 1.5 * max(1.0, report.tile_seam_energy_source.ratio)
    assert report.colour_drift_delta_e < 1.0 and report.source_psnr_db > 45


def test_flicker_at_a_join_is_found_by_both_temporal_measures(truth) -> None:
    """Every other frame of each join 10 levels brighter."""
    ideal, source = truth
    joins, _ = join_pairs(PLAN.windows, ())
    flickering = ideal.astype(np.int16)
    for pairs in joins:
        flickering[sorted(pairs)[::2]] += 10
    report = meter_report(np.clip(flickering, 0, 255).astype(np.uint8), source)
    assert report.join_difference_energy.ratio > 50 and report.join_warping_error.ratio > 5
    assert [f for f in report.findings if f.startswith("flicker at window joins")]
    assert not [f for f in report.findings if f.startswith(("tile seams", "colour drift"))]


def test_a_hard_join_without_cross_fade_is_found_and_the_cross_fade_hides_it(truth) -> None:
    """Every other window 12 levels brighter: windows that abut (overlap 0) jump in one pair; the cross-fade of
    overlapping ones spreads the change over their shared frames, which both measures see as far less."""
    windows = plan_windows(242, 0)
    assert [w.start for w in windows] == [0, 121]
    ideal = pattern(242, 64, 96, 2.0)
    source = ideal.reshape(242, 32, 2, 48, 2, 3).mean(axis=(2, 4)).round().astype(np.uint8)
    hard = meter_report(per_window(ideal, windows, brighter), source, windows=windows)
    assert hard.joins == 1 and hard.join_difference_energy.ratio > 100 and hard.join_warping_error.ratio > 3
    assert [f for f in hard.findings if f.startswith("flicker at window joins")]
    faded = meter_report(per_window(truth[0], PLAN.windows, brighter), truth[1])
    assert faded.join_difference_energy.ratio < hard.join_difference_energy.ratio / 20
    assert faded.join_warping_error.ratio < hard.join_warping_error.ratio / 2


def test_a_tile_seam_is_found_at_its_border(truth) -> None:
    ideal, source = truth
    seamed = ideal.astype(np.int16)
    seamed[:, :, 56:] += 10  # the tiles right of column 56 come out brighter
    report = meter_report(np.clip(seamed, 0, 255).astype(np.uint8), source)
    assert report.tile_seam_energy.ratio > 3 * report.tile_seam_energy_source.ratio
    assert [f for f in report.findings if f.startswith("tile seams")]
    # Measured at borders that are not where the step is, the same output shows no seam.
    elsewhere = meter_report(np.clip(seamed, 0, 255).astype(np.uint8), source, borders=([16], [24]))
    assert not [f for f in elsewhere.findings if f.startswith("tile seams")]


def test_a_colour_shift_is_found(truth) -> None:
    ideal, source = truth
    warmer = np.clip(ideal * np.array([1.12, 1.0, 0.88]), 0, 255).astype(np.uint8)
    report = meter_report(warmer, source)
    assert report.colour_drift_delta_e > 3 and [f for f in report.findings if f.startswith("colour drift")]
    # A uniform shift is no flicker and no seam.
    assert not [f for f in report.findings if f.startswith(("flicker", "tile seams"))]


def test_an_output_unrelated_to_its_source_is_inconsistent(truth) -> None:
    ideal, source = truth
    noise = np.random.default_rng(0).integers(0, 256, ideal.shape, dtype=np.uint8)
    report = meter_report(noise, source)
    assert report.source_psnr_db < 15 and [f for f in report.findings if f.startswith("inconsistent")]


def test_joins_and_cuts_are_where_the_plan_puts_them() -> None:
    windows = plan_windows(250, 16)  # starts 0, 64, 129
    joins, cuts = join_pairs(windows, ())
    assert joins == [set(range(64, 122)), set(range(129, 186))] and cuts == set()
    scenes = plan_scene_windows(250, 16, (100,))  # shot 1 is one window, shot 2 two
    joins, cuts = join_pairs(scenes, (100,))
    assert cuts == {100} and len(joins) == 1 and min(joins[0]) == scenes[2].start


def test_a_scene_cut_counts_as_no_flicker(truth) -> None:
    ideal, source = truth
    cut = np.concatenate([ideal[:100], 255 - ideal[100:]])
    cut_source = np.concatenate([source[:100], 255 - source[100:]])
    windows = plan_scene_windows(FRAMES, 16, (100,))
    report = meter_report(cut, cut_source, windows=windows, cuts=(100,))
    assert report.findings == [] and report.joins == 1


def test_tile_borders_follow_the_grid_and_the_delivery_size() -> None:
    plan = make_plan((512, 1024), 9, 24.0, UpscaleParams(scale=2), ModelTraits())
    grid = plan.grid
    rows, cols = tile_borders(plan)
    expected = sorted({2 * left for left in grid.lefts[1:]} | {2 * left + grid.base[1] for left in grid.lefts[:-1]})
    assert cols == expected and len(grid.lefts) > 1
    hd = make_plan((512, 1024), 9, 24.0, UpscaleParams(scale=2, target_resolution="hd"), ModelTraits())
    assert tile_borders(hd)[1] == [round(c * hd.delivery_size[1] / hd.sr_size[1]) for c in cols]


def test_measure_checks_the_frame_count(truth) -> None:
    ideal, source = truth
    with pytest.raises(ValueError, match="249 frames to measure, its plan 250"):
        measure(PLAN, ideal[:-1], source)
    assert measure(PLAN, ideal, source).frames == FRAMES


def test_the_report_artifact_has_a_quality_section(truth) -> None:
    from flows.artifacts import quality_markdown

    ideal, source = truth
    clean = quality_markdown(meter_report(ideal, source))
    assert clean[0] == "## Quality" and "no measure past its limit" in clean[-1]
    assert "| flicker at window joins: difference energy |" in clean[1]
    warmer = np.clip(ideal * np.array([1.12, 1.0, 0.88]), 0, 255).astype(np.uint8)
    assert "colour drift: mean ΔE" in quality_markdown(meter_report(warmer, source))[-1]
    assert quality_markdown(None) == []


def _parts(outputs: np.ndarray, sources: np.ndarray, windows, cuts, borders) -> list:
    """Each window's segment measured on its own, as the flow's quality items do, and kept as bytes."""
    from k6vsr_core.contract.quality import Measures
    from k6vsr_core.contract.windows import segment_range

    parts = []
    for window in range(len(windows)):
        start, stop = segment_range(windows, window)
        meter = QualityMeter(windows, cuts, borders, first=start)
        for output, source in zip(outputs[start:stop], sources[start:stop], strict=True):
            meter.add(output, source)
        parts.append(Measures.from_bytes(meter.measures().to_bytes()))
    return parts


@pytest.mark.parametrize("cut", [None, 100])
def test_the_windows_parts_joined_give_the_whole_outputs_report(truth, cut) -> None:
    """Measured segment by segment (in any order) and joined, the report is the one of a pass over the whole
    output, to the last digit, the pairs across each segment's start included; a cut's pair counts in neither."""
    from k6vsr_core.contract.quality import combine

    ideal, source = truth
    windows, cuts = PLAN.windows, ()
    if cut is not None:
        windows, cuts = plan_scene_windows(FRAMES, 16, (cut,)), (cut,)
        ideal = np.concatenate([ideal[:cut], 255 - ideal[cut:]])
        source = np.concatenate([source[:cut], 255 - source[cut:]])
    output = per_window(ideal, windows, brighter).astype(np.int16)
    for pairs in join_pairs(windows, cuts)[0]:  # a flicker at each join, from the segment's first frame on
        output[sorted(pairs)[::2]] += 10
    output = np.clip(output, 0, 255).astype(np.uint8)
    whole = meter_report(output, source, windows=windows, cuts=cuts)
    parts = _parts(output, source, windows, cuts, BORDERS)
    assert len(parts) == len(windows) > 2
    joined = combine(parts[::-1], windows, cuts, BORDERS)
    assert joined.model_dump(exclude={"seconds"}) == whole.model_dump(exclude={"seconds"})
    assert joined.join_difference_energy.ratio > 20 and joined.findings
    with pytest.raises(ValueError, match="next part starts at"):
        combine(parts[:1] + parts[2:], windows, cuts, BORDERS)
