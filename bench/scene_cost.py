"""What scene-cut detection costs per minute of source on this machine, against a GPU run's wall time.

Writes a `make_sample_clip` clip (no cut) of `--frames` frames at each `--size`, times `source_cuts` on all its
frames and the decode alone (`media.iter_frames` at the detector's width), and scales both to a minute of 24-fps
source (1440 frames). `--gpu-seconds-per-minute` is a one-GPU run's wall time per minute of source (641 s: W4,
768x512 at x2 on an H200, bench/RESULTS.md 2026-12-01).

    PYTHONPATH=$PWD python bench/scene_cost.py [--frames 240] [--size 1280x720 --size 768x512]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from k6vsr_core import media
from k6vsr_core.contract.scenes import DETECT_WIDTH, source_cuts
from k6vsr_core.media.sample import make_sample_clip

MINUTE = 24 * 60


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=240, help="frames of each clip")
    parser.add_argument("--size", action="append", help="WxH (repeatable; default 1280x720 and 768x512)")
    parser.add_argument("--gpu-seconds-per-minute", type=float, default=641.0, help="GPU wall time a source minute")
    args = parser.parse_args()
    source_cuts(make_sample_clip(Path(tempfile.mkdtemp()) / "warm.mp4", num_frames=9, audio=False), list(range(9)))
    for size in args.size or ["1280x720", "768x512"]:
        width, height = (int(v) for v in size.split("x"))
        with tempfile.TemporaryDirectory() as folder:
            path = make_sample_clip(Path(folder) / "clip.mp4", width=width, height=height, num_frames=args.frames)
            indices = list(range(args.frames))
            started = time.perf_counter()
            for _ in media.iter_frames(path, indices, DETECT_WIDTH):
                pass
            decode = time.perf_counter() - started
            started = time.perf_counter()
            cuts = source_cuts(path, indices)
            detect = time.perf_counter() - started
        per_minute = detect * MINUTE / args.frames
        print(
            f"{size}: {args.frames} frames, cuts {list(cuts)}, detection {detect:.2f} s (decode alone {decode:.2f} s),"
            f" {per_minute:.1f} s a minute of source, {100 * per_minute / args.gpu_seconds_per_minute:.2f} % of"
            f" {args.gpu_seconds_per_minute:.0f} s of GPU run"
        )


if __name__ == "__main__":
    main()
