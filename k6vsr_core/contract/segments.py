"""A clip's output file from its windows' encoded frames: no tensor is involved, so the process that joins the
segments (the flow's own, with warm workers) imports no torch."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from k6vsr_core import media
from k6vsr_core.contract.plan import ClipPlan


def write_segment(
    path: str | Path, frames: np.ndarray, plan: ClipPlan, audio: np.ndarray | None, rotation: int, window: int
) -> None:
    """Window `window`'s segment. A one-window plan's only segment is the finished file, written as the contract
    writes it (video, audio, rotation), unless the source's own streams go in; otherwise it is video only, for
    `join_segments`. Kept frame times are the window's own, from its first frame."""
    encoding = plan.encoding
    clock = plan.clock
    if isinstance(clock, media.Timeline):
        clock = clock.part(*plan.segment_range(window))
    if _segment_is_output(plan):
        media.write_video(path, frames, clock, audio, rotation, encoding, plan.colour, plan.hdr, plan.sample_aspect)
    else:
        media.write_segment(path, frames, clock, encoding, plan.colour, plan.sample_aspect, plan.hdr)


def join_segments(
    segments: list[str],
    path: str | Path,
    plan: ClipPlan,
    audio: np.ndarray | None,
    rotation: int,
    source: str | None = None,
) -> None:
    """The output from the segments in window order, by stream copy, with the audio (or, with `--audio original`,
    the streams of `source`), then decoded once and checked against the plan (`media.check_output`): a file that
    does not hold what was planned is removed and an `OutputMismatch` says why, so nothing is published."""
    original = source if plan.params.audio == "original" else None
    if plan.params.audio == "original" and source is None:
        raise ValueError("audio='original' needs the source file to carry its streams from")
    if _segment_is_output(plan):
        shutil.copyfile(segments[0], path)
    else:
        media.concat_segments(
            segments,
            path,
            plan.clock,
            audio,
            plan.num_frames,
            rotation,
            plan.encoding,
            original,
            plan.sample_aspect,
        )
    planned = media.planned_output(
        plan.encoding,
        plan.num_frames,
        plan.clock,
        plan.delivery_size,
        0 if audio is None else len(audio),
        original,
        plan.colour,
        plan.sample_aspect,
        plan.hdr,
    )
    try:
        media.check_output(path, planned)
    except media.OutputMismatch:
        Path(path).unlink(missing_ok=True)
        raise


def _segment_is_output(plan: ClipPlan) -> bool:
    return plan.num_windows == 1 and plan.params.audio != "original"
