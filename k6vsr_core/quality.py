"""The quality report of an output: weight-free measures of what windows and tiles can spoil, on the CPU.

Each measure compares the output with its source, frame by frame, so that what the footage itself does (motion, cuts,
edges) is not blamed on the upscaler:

- **Flicker at window joins.** Two per-frame-pair figures, each compared between the pairs where two windows are
  joined (the cross-fade and its two edges) and the pairs inside windows: the *difference energy*, the mean square of
  the output's frame-to-frame change beyond the source's (output scaled down to the source's size, so an upscaler
  that follows the source scores near 0 everywhere); and the *warping error*, the mean absolute difference between
  an output frame and the one before it warped onto it by the source's motion (OpenCV's DIS optical flow, computed
  on the source). A join no worse than the inside of a window has a ratio near 1. Pairs across a scene cut of the
  plan count in neither.
- **Tile seams.** The mean square of the output's pixel steps into the tile borders' rows and columns (where a
  tile's blending region ends) against the steps 2 to 5 pixels beside them, next to the same ratio for the
  bicubic-upscaled source, whose own edges may fall there.
- **Colour drift.** The mean CIELAB ΔE (CIE 1976) between the output and the bicubic-upscaled source, both averaged
  over blocks of `COLOUR_BLOCK` output pixels: the colour, not the detail the upscaler adds.
- **Consistency with the source.** The PSNR of the output scaled down to the source's size (area averaging)
  against the source: an upscaler that only adds detail scores high.

Seams, colour and consistency are measured on every `SPATIAL_EVERY`-th frame, which is enough for quantities that
change slowly; the temporal measures need every pair, and are taken on frames scaled down to at most
`TEMPORAL_WIDTH` pixels wide. Together these keep the report a few per cent of a run (README, "Quality report").
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict

from k6vsr_core import media
from k6vsr_core.plan import ClipPlan
from k6vsr_core.windows import Window

SPATIAL_EVERY = 8
TEMPORAL_WIDTH = 320
COLOUR_BLOCK = 16
# Findings: a measure past its limit is named in `findings`. A join or a border more than 1.5x the inside level is
# visible on a still-camera shot; ΔE 3 is about where people notice a colour change side by side; a consistency
# under 30 dB means the output no longer downscales to its source.
RATIO_LIMIT = 1.5
DELTA_E_LIMIT = 3.0
PSNR_LIMIT_DB = 30.0
_FLOOR = 1e-6  # a perfectly flat inside level would make every ratio infinite


class Comparison(BaseModel):
    """A measure where it is suspect (`at`) and elsewhere (`inside`), and their ratio."""

    model_config = ConfigDict(frozen=True)

    at: float
    inside: float
    ratio: float


class QualityReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    frames: int
    joins: int  # window joins measured (pairs of windows sharing frames, or abutting inside a shot)
    join_difference_energy: Comparison | None  # None with no join
    join_warping_error: Comparison | None
    tile_borders: int  # tile borders inside the output, rows and columns
    tile_seam_energy: Comparison | None  # None with one tile
    tile_seam_energy_source: Comparison | None  # the bicubic-upscaled source's own, at the same borders
    colour_drift_delta_e: float  # mean over the frames measured
    colour_drift_delta_e_max: float  # the worst frame's
    source_psnr_db: float
    findings: list[str]  # the measures past their limits, in words; empty when the output is clean
    seconds: float  # what measuring took


def join_pairs(windows: tuple[Window, ...], cuts: tuple[int, ...]) -> tuple[list[set[int]], set[int]]:
    """For each join between neighbouring windows of one shot, the frames `t` whose pair `(t - 1, t)` crosses it
    (the shared frames and the first frame after them); and the frames that start a shot, whose pair is a cut."""
    joins = []
    for index in range(1, len(windows)):
        before, window = windows[index - 1], windows[index]
        if window.start in cuts:
            continue
        joins.append(set(range(max(1, window.start), min(before.stop, windows[-1].stop - 1) + 1)))
    return joins, set(cuts)


def tile_borders(plan: ClipPlan) -> tuple[list[int], list[int]]:
    """The rows and columns of the output where a tile's blending region ends (a tile's first or last row or
    column), scaled to the delivered size; the image's own edges are not borders."""
    grid = plan.grid
    height, width = plan.sr_size
    scale_y, scale_x = plan.delivery_size[0] / height, plan.delivery_size[1] / width

    def borders(starts: tuple[int, ...], tile: int, length: int, scale: float) -> list[int]:
        edges = {start * grid.tiling_scale for start in starts} | {start * grid.tiling_scale + tile for start in starts}
        return sorted({round(edge * scale) for edge in edges if 0 < edge < length})

    return borders(grid.tops, grid.base[0], height, scale_y), borders(grid.lefts, grid.base[1], width, scale_x)


class QualityMeter:
    """Fed the output's frames and the source's kept frames in order, one pair at a time; `report()` at the end.
    Holds two frames of each, whatever the length."""

    def __init__(
        self, windows: tuple[Window, ...], cuts: tuple[int, ...], borders: tuple[list[int], list[int]]
    ) -> None:
        import cv2  # here: the report's model is imported by commands that never measure

        self._joins, self._cuts = join_pairs(windows, cuts)
        self._borders = borders
        self._flow = cv2.DISOpticalFlow_create(cv2.DISOPTICAL_FLOW_PRESET_ULTRAFAST)
        self._frame = 0
        self._previous: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # scaled output, source, grey source
        self._energy: dict[int, float] = {}
        self._warping: dict[int, float] = {}
        self._seams: list[tuple[float, float, float, float]] = []  # output at, inside; source at, inside
        self._delta_e: list[float] = []
        self._squared_error = 0.0
        self._samples = 0
        self._seconds = 0.0

    def add(self, output: np.ndarray, source: np.ndarray) -> None:
        """One output frame `(H, W, 3)` uint8 and the source frame it was made from."""
        import cv2

        started = time.perf_counter()
        height, width = source.shape[:2]
        # Temporal measures at most `TEMPORAL_WIDTH` wide: a join's flicker is in the whole picture, not in detail.
        # An integer factor of the source: OpenCV's area averaging is several times faster at whole ratios.
        factor = max(1, math.ceil(width / TEMPORAL_WIDTH))
        size = (max(8, width // factor), max(8, height // factor))
        small = cv2.resize(output, size, interpolation=cv2.INTER_AREA).astype(np.float32)
        src = source if size == (width, height) else cv2.resize(source, size, interpolation=cv2.INTER_AREA)
        grey = cv2.cvtColor(src, cv2.COLOR_RGB2GRAY)
        src = src.astype(np.float32)
        t = self._frame
        if self._previous is not None and t not in self._cuts:
            before, src_before, grey_before = self._previous
            change = (small - before) - (src - src_before)
            self._energy[t] = float(np.mean(change * change))
            self._warping[t] = float(np.mean(np.abs(small - _warp(before, self._flow.calc(grey, grey_before, None)))))
        if t % SPATIAL_EVERY == 0:
            scaled = cv2.resize(output, (width, height), interpolation=cv2.INTER_AREA).astype(np.float32)
            difference = scaled - source.astype(np.float32)
            self._squared_error += float(np.mean(difference * difference))
            self._samples += 1
            upscaled = cv2.resize(source, (output.shape[1], output.shape[0]), interpolation=cv2.INTER_CUBIC)
            if self._borders[0] or self._borders[1]:
                self._seams.append((*_step_energy(output, self._borders), *_step_energy(upscaled, self._borders)))
            self._delta_e.append(_delta_e(output, upscaled))
        self._previous = (small, src, grey)
        self._frame += 1
        self._seconds += time.perf_counter() - started

    def report(self) -> QualityReport:
        if not self._frame:
            raise ValueError("no frame was measured")
        joins = [pairs & self._energy.keys() for pairs in self._joins]
        joins = [pairs for pairs in joins if pairs]
        inside = self._energy.keys() - set().union(*joins) if joins else set()
        energy = _compare(self._energy, joins, inside)
        warping = _compare(self._warping, joins, inside)
        seams = source_seams = None
        if self._seams:
            rows = np.asarray(self._seams)
            seams = _comparison(float(rows[:, 0].mean()), float(rows[:, 1].mean()))
            source_seams = _comparison(float(rows[:, 2].mean()), float(rows[:, 3].mean()))
        mse = self._squared_error / self._samples
        psnr = 99.0 if mse <= 1e-10 else 10 * math.log10(255.0**2 / mse)
        delta_e = float(np.mean(self._delta_e)) if self._delta_e else 0.0
        findings = _findings(energy, warping, seams, source_seams, delta_e, psnr)
        return QualityReport(
            frames=self._frame,
            joins=len(joins),
            join_difference_energy=energy,
            join_warping_error=warping,
            tile_borders=len(self._borders[0]) + len(self._borders[1]),
            tile_seam_energy=seams,
            tile_seam_energy_source=source_seams,
            colour_drift_delta_e=round(delta_e, 3),
            colour_drift_delta_e_max=round(max(self._delta_e, default=0.0), 3),
            source_psnr_db=round(psnr, 2),
            findings=findings,
            seconds=round(self._seconds, 3),
        )


def measure(plan: ClipPlan, outputs: Iterable[np.ndarray], sources: Iterable[np.ndarray]) -> QualityReport:
    """The report of an output of `plan` from its frames and the source's kept frames, in order."""
    meter = QualityMeter(plan.windows, plan.cuts, tile_borders(plan))
    count = 0
    for output, source in zip(outputs, sources, strict=False):
        meter.add(output, source)
        count += 1
    if count != plan.num_frames:
        raise ValueError(f"the output has {count} frames to measure, its plan {plan.num_frames}")
    return meter.report()


def measure_files(plan: ClipPlan, output: str | Path, source: str | Path) -> QualityReport:
    """The report of the output file of `plan` made from the video `source`, both decoded once, a frame at a time;
    `seconds` counts the decoding."""
    started = time.perf_counter()
    outputs = media.iter_frames(output, list(range(plan.num_frames)))
    report = measure(plan, outputs, media.iter_frames(source, plan.source_indices()))
    return report.model_copy(update={"seconds": round(time.perf_counter() - started, 3)})


def _warp(frame: np.ndarray, flow: np.ndarray) -> np.ndarray:
    """`frame` moved onto the next one: each pixel of the next frame fetched from where the flow says it was."""
    import cv2

    height, width = flow.shape[:2]
    xs, ys = np.meshgrid(np.arange(width, dtype=np.float32), np.arange(height, dtype=np.float32))
    return cv2.remap(frame, xs + flow[..., 0], ys + flow[..., 1], cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)


def _step_energy(frame: np.ndarray, borders: tuple[list[int], list[int]]) -> tuple[float, float]:
    """Mean square pixel step into the border rows and columns, and the same next to them (2 to 5 pixels either
    side): a seam is a step its neighbourhood does not have, where the picture's own detail is about the same."""
    at, near = [], []
    for axis, edges in ((0, borders[0]), (1, borders[1])):
        length = frame.shape[axis]
        for edge in edges:
            # Step i is from line i to line i + 1; the border's own is the step into it, edge - 1.
            steps = [edge - 1 + k for k in (-5, -4, -3, -2, 0, 2, 3, 4, 5) if 0 <= edge - 1 + k < length - 1]
            lines = np.take(frame, steps, axis=axis).astype(np.float32)
            following = np.take(frame, [i + 1 for i in steps], axis=axis).astype(np.float32)
            energy = np.mean((following - lines) ** 2, axis=tuple(a for a in range(3) if a != axis))
            own = steps.index(edge - 1)
            at.append(float(energy[own]))
            near.append(float(np.mean(np.delete(energy, own))))
    return float(np.mean(at)) if at else 0.0, float(np.mean(near)) if near else 0.0


def _delta_e(output: np.ndarray, reference: np.ndarray) -> float:
    import cv2

    height, width = output.shape[:2]
    size = (max(1, width // COLOUR_BLOCK), max(1, height // COLOUR_BLOCK))
    labs = [
        cv2.cvtColor(cv2.resize(img, size, interpolation=cv2.INTER_AREA).astype(np.float32) / 255.0, cv2.COLOR_RGB2Lab)
        for img in (output, reference)
    ]
    return float(np.mean(np.linalg.norm(labs[0] - labs[1], axis=-1)))


def _comparison(at: float, inside: float) -> Comparison:
    return Comparison(at=round(at, 4), inside=round(inside, 4), ratio=round(at / max(inside, _FLOOR), 3))


def _compare(values: dict[int, float], joins: list[set[int]], inside: set[int]) -> Comparison | None:
    """The worst join's mean against the median inside the windows."""
    if not joins or not inside:
        return None
    worst = max(float(np.mean([values[t] for t in pairs])) for pairs in joins)
    return _comparison(worst, float(np.median([values[t] for t in inside])))


def _findings(
    energy: Comparison | None,
    warping: Comparison | None,
    seams: Comparison | None,
    source_seams: Comparison | None,
    delta_e: float,
    psnr: float,
) -> list[str]:
    found = []
    if energy is not None and warping is not None and max(energy.ratio, warping.ratio) > RATIO_LIMIT:
        found.append(
            f"flicker at window joins: {energy.ratio:g}x the difference energy and {warping.ratio:g}x the warping "
            "error inside windows"
        )
    if seams is not None and source_seams is not None and seams.ratio > RATIO_LIMIT * max(1.0, source_seams.ratio):
        found.append(
            f"tile seams: {seams.ratio:g}x the pixel step inside tiles (the source's: {source_seams.ratio:g}x)"
        )
    if delta_e > DELTA_E_LIMIT:
        found.append(f"colour drift: mean ΔE {delta_e:.2f} against the bicubic-upscaled source")
    if psnr < PSNR_LIMIT_DB:
        found.append(f"inconsistent with the source: {psnr:.1f} dB PSNR scaled down to it")
    return found
