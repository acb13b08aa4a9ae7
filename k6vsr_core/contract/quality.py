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
`TEMPORAL_WIDTH` pixels wide. Together these keep the report a few per cent of a run's work; measured window by
window (`Measures`, joined by `combine`) while the model computes the next windows, little of it is left on the run's
tail (docs/processing.md).
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict

from k6vsr_core import media
from k6vsr_core.contract.plan import ClipPlan
from k6vsr_core.contract.windows import Window, segment_range

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


# A frame as the temporal measures see it: the output scaled down, the source at that size, and its grey (uint8).
Reduced = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass
class Measures:
    """The per-frame measures of the output's frames `[first, stop)`, and those frames' first and last reduced
    (`head`, `tail`): what a window's segment contributes to the report, kept in the run store while the run goes
    on. The pair that crosses into `first` needs the frame before it, so it is measured when the parts are joined
    (`combine`). Values are per frame (a pair `(t - 1, t)` under `t`), so that the parts joined give the very
    numbers, in the very order, of one pass over the whole output."""

    first: int
    stop: int
    energy: dict[int, float] = field(default_factory=dict)
    warping: dict[int, float] = field(default_factory=dict)
    seams: dict[int, tuple[float, float, float, float]] = field(default_factory=dict)  # output at, inside; source
    delta_e: dict[int, float] = field(default_factory=dict)
    squared_error: dict[int, float] = field(default_factory=dict)
    head: Reduced | None = None
    tail: Reduced | None = None
    seconds: float = 0.0

    def to_bytes(self) -> bytes:
        """An `.npz` of the measures (float64, exact) and the reduced frames."""
        arrays: dict[str, np.ndarray] = {"span": np.array([self.first, self.stop]), "seconds": np.array(self.seconds)}
        for name in ("energy", "warping", "delta_e", "squared_error"):
            values: dict[int, float] = getattr(self, name)
            arrays[f"{name}_frames"] = np.array(sorted(values), dtype=np.int64)
            arrays[name] = np.array([values[t] for t in sorted(values)], dtype=np.float64)
        arrays["seams_frames"] = np.array(sorted(self.seams), dtype=np.int64)
        arrays["seams"] = np.array([self.seams[t] for t in sorted(self.seams)], dtype=np.float64).reshape(-1, 4)
        for end in ("head", "tail"):
            frame = getattr(self, end)
            if frame is not None:
                for name, array in zip(("small", "src", "grey"), frame, strict=True):
                    arrays[f"{end}_{name}"] = array
        buffer = io.BytesIO()
        np.savez(buffer, allow_pickle=False, **arrays)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> Measures:
        with np.load(io.BytesIO(data)) as stored:
            first, stop = (int(v) for v in stored["span"])
            parts = cls(first, stop, seconds=float(stored["seconds"]))
            for name in ("energy", "warping", "delta_e", "squared_error"):
                frames, values = stored[f"{name}_frames"], stored[name]
                setattr(parts, name, {int(t): float(v) for t, v in zip(frames, values, strict=True)})
            parts.seams = {
                int(t): (float(row[0]), float(row[1]), float(row[2]), float(row[3]))
                for t, row in zip(stored["seams_frames"], stored["seams"], strict=True)
            }
            for end in ("head", "tail"):
                if f"{end}_small" in stored:
                    setattr(parts, end, tuple(stored[f"{end}_{name}"] for name in ("small", "src", "grey")))
        return parts


class QualityMeter:
    """Fed the output's frames and the source's kept frames in order, one pair at a time, from frame `first`;
    `measures()` gives what it measured, `report()` the report when it was fed the whole output. Holds two frames of
    each, whatever the length."""

    def __init__(
        self,
        windows: tuple[Window, ...],
        cuts: tuple[int, ...],
        borders: tuple[list[int], list[int]],
        first: int = 0,
    ) -> None:
        import cv2  # here: the report's model is imported by commands that never measure

        self._windows, self._cuts = windows, cuts
        self._borders = borders
        self._flow = cv2.DISOpticalFlow.create(cv2.DISOPTICAL_FLOW_PRESET_ULTRAFAST)
        self._measures = Measures(first, first)
        self._previous: Reduced | None = None

    def add(self, output: np.ndarray, source: np.ndarray) -> None:
        """One output frame `(H, W, 3)` uint8 and the source frame it was made from."""
        import cv2

        started = time.perf_counter()
        m = self._measures
        t = m.stop
        reduced = _reduce(output, source)
        if self._previous is not None and t not in self._cuts:
            m.energy[t], m.warping[t] = _pair(self._previous, reduced, self._flow)
        if t % SPATIAL_EVERY == 0:
            height, width = source.shape[:2]
            scaled = cv2.resize(output, (width, height), interpolation=cv2.INTER_AREA).astype(np.float32)
            difference = scaled - source.astype(np.float32)
            m.squared_error[t] = float(np.mean(difference * difference))
            upscaled = cv2.resize(source, (output.shape[1], output.shape[0]), interpolation=cv2.INTER_CUBIC)
            if self._borders[0] or self._borders[1]:
                m.seams[t] = (*_step_energy(output, self._borders), *_step_energy(upscaled, self._borders))
            m.delta_e[t] = _delta_e(output, upscaled)
        if m.head is None:
            m.head = reduced
        m.tail = self._previous = reduced
        m.stop += 1
        m.seconds += time.perf_counter() - started

    def measures(self) -> Measures:
        return self._measures

    def report(self) -> QualityReport:
        return combine([self._measures], self._windows, self._cuts, self._borders)


def combine(
    parts: Iterable[Measures], windows: tuple[Window, ...], cuts: tuple[int, ...], borders: tuple[list[int], list[int]]
) -> QualityReport:
    """The report of the whole output from the measures of consecutive parts of it, which must cover it from frame
    0 without a gap: the pairs that cross from one part into the next are measured here, from the parts' ends."""
    import cv2

    started = time.perf_counter()
    ordered = sorted(parts, key=lambda part: part.first)
    if not ordered or ordered[-1].stop == 0:
        raise ValueError("no frame was measured")
    whole = Measures(0, 0, seconds=sum(part.seconds for part in ordered))
    flow = None
    for part in ordered:
        if part.first != whole.stop:
            raise ValueError(f"the measures cover frames up to {whole.stop}, the next part starts at {part.first}")
        if part.first and part.first not in cuts and part.head is not None and whole.tail is not None:
            flow = flow or cv2.DISOpticalFlow.create(cv2.DISOPTICAL_FLOW_PRESET_ULTRAFAST)
            whole.energy[part.first], whole.warping[part.first] = _pair(whole.tail, part.head, flow)
        for name in ("energy", "warping", "seams", "delta_e", "squared_error"):
            getattr(whole, name).update(getattr(part, name))
        whole.stop, whole.tail = part.stop, part.tail if part.tail is not None else whole.tail
    frames, joins_at = whole.stop, join_pairs(windows, cuts)[0]
    joins = [pairs & whole.energy.keys() for pairs in joins_at]
    joins = [pairs for pairs in joins if pairs]
    inside = whole.energy.keys() - set().union(*joins) if joins else set()
    energy = _compare(whole.energy, joins, inside)
    warping = _compare(whole.warping, joins, inside)
    seams = source_seams = None
    if whole.seams:
        rows = np.asarray([whole.seams[t] for t in sorted(whole.seams)])
        seams = _comparison(float(rows[:, 0].mean()), float(rows[:, 1].mean()))
        source_seams = _comparison(float(rows[:, 2].mean()), float(rows[:, 3].mean()))
    squared_error = 0.0
    for t in sorted(whole.squared_error):  # added in frame order, as one pass over the output adds them
        squared_error += whole.squared_error[t]
    mse = squared_error / len(whole.squared_error)
    psnr = 99.0 if mse <= 1e-10 else 10 * math.log10(255.0**2 / mse)
    delta_es = [whole.delta_e[t] for t in sorted(whole.delta_e)]
    delta_e = float(np.mean(delta_es)) if delta_es else 0.0
    findings = _findings(energy, warping, seams, source_seams, delta_e, psnr)
    return QualityReport(
        frames=frames,
        joins=len(joins),
        join_difference_energy=energy,
        join_warping_error=warping,
        tile_borders=len(borders[0]) + len(borders[1]),
        tile_seam_energy=seams,
        tile_seam_energy_source=source_seams,
        colour_drift_delta_e=round(delta_e, 3),
        colour_drift_delta_e_max=round(max(delta_es, default=0.0), 3),
        source_psnr_db=round(psnr, 2),
        findings=findings,
        seconds=round(whole.seconds + time.perf_counter() - started, 3),
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


def measure_segment(
    plan: ClipPlan, window: int, segment: str | Path, source: str | Path, frame_pts: np.ndarray | None = None
) -> Measures:
    """The measures of the output's frames that window `window`'s segment holds, decoded from the segment file (the
    output's mux copies its stream: the same frames) and from the source (`frame_pts`: its frame index, for a seek);
    `seconds` counts the decoding."""
    started = time.perf_counter()
    start, stop = segment_range(plan.windows, window)
    meter = QualityMeter(plan.windows, plan.cuts, tile_borders(plan), first=start)
    sources = media.read_frames(source, plan.source_indices()[start:stop], frame_pts, plan.deinterlace)
    for output, frame in zip(media.iter_frames(segment, list(range(stop - start))), sources, strict=False):
        meter.add(output, frame)
    measures = meter.measures()
    if measures.stop != stop:
        raise ValueError(f"the segment of window {window} has {measures.stop - start} frames, its plan {stop - start}")
    measures.seconds = time.perf_counter() - started
    return measures


def measure_files(plan: ClipPlan, output: str | Path, source: str | Path) -> QualityReport:
    """The report of the output file of `plan` made from the video `source`, both decoded once, a frame at a time;
    `seconds` counts the decoding."""
    started = time.perf_counter()
    outputs = media.iter_frames(output, list(range(plan.num_frames)))
    report = measure(plan, outputs, media.iter_frames(source, plan.source_indices(), fields=plan.deinterlace))
    return report.model_copy(update={"seconds": round(time.perf_counter() - started, 3)})


def _reduce(output: np.ndarray, source: np.ndarray) -> Reduced:
    """The frame as the temporal measures see it: at most `TEMPORAL_WIDTH` wide, for a join's flicker is in the
    whole picture, not in detail; an integer factor of the source's size, where OpenCV's area averaging is several
    times faster."""
    import cv2

    height, width = source.shape[:2]
    factor = max(1, math.ceil(width / TEMPORAL_WIDTH))
    size = (max(8, width // factor), max(8, height // factor))
    small = cv2.resize(output, size, interpolation=cv2.INTER_AREA)
    src = source if size == (width, height) else cv2.resize(source, size, interpolation=cv2.INTER_AREA)
    return small, src, cv2.cvtColor(src, cv2.COLOR_RGB2GRAY)


def _pair(before: Reduced, after: Reduced, flow: object) -> tuple[float, float]:
    """Difference energy and warping error of the pair (before, after)."""
    small_before, src_before, grey_before = (a.astype(np.float32) if i < 2 else a for i, a in enumerate(before))
    small, src, grey = (a.astype(np.float32) if i < 2 else a for i, a in enumerate(after))
    change = (small - small_before) - (src - src_before)
    energy = float(np.mean(change * change))
    warped = _warp(small_before, flow.calc(grey, grey_before, None))  # type: ignore[attr-defined]
    return energy, float(np.mean(np.abs(small - warped)))


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
