"""What the quality report costs against the run it describes.

    python bench/quality_cost.py [--frames 250] [--size 64] [--out FILE]

Runs the in-memory runner with the tiny random bundle on the CPU on a synthetic clip, then measures the quality
report of its output (`k6vsr_core.quality.measure_files`: decoding the output and the source, and every measure),
and prints both times and their ratio. It also times the report alone on a 1280x720 output of a 640x360 source
(frames in memory, decoding excluded), per frame, to compare with the model's time per frame on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from k6vsr_core import UpscaleParams, upscale  # noqa: E402
from k6vsr_core.bundle import load_bundle, make_tiny_bundle  # noqa: E402
from k6vsr_core.plan import ModelTraits, make_plan  # noqa: E402
from k6vsr_core.quality import QualityMeter, measure_files, tile_borders  # noqa: E402
from k6vsr_core.sample import make_sample_clip  # noqa: E402


def large_frames_per_second(frames: int = 24) -> float:
    """Frames a second the measures take on 1280x720 outputs of 640x360 sources, decoding excluded."""
    rng = np.random.default_rng(0)
    plan = make_plan((360, 640), 250, 24.0, UpscaleParams(scale=2), ModelTraits())
    meter = QualityMeter(plan.windows, plan.cuts, tile_borders(plan))
    source = rng.integers(0, 256, (frames, 360, 640, 3), dtype=np.uint8)
    output = np.repeat(np.repeat(source, 2, axis=1), 2, axis=2)
    started = time.perf_counter()
    for out, src in zip(output, source, strict=True):
        meter.add(out, src)
    return frames / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=250)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        bundle = load_bundle(str(make_tiny_bundle(work / "bundle")))
        clip = make_sample_clip(work / "clip.mp4", width=args.size, height=args.size, num_frames=args.frames, fps=24)
        started = time.perf_counter()
        result = upscale(clip, work / "out.mp4", bundle, UpscaleParams(scale=2))
        run_s = time.perf_counter() - started
        report = measure_files(result.plan, work / "out.mp4", clip)
    row = {
        "frames": args.frames,
        "source": f"{args.size}x{args.size}",
        "run_s": round(run_s, 2),
        "quality_s": report.seconds,
        "quality_share": round(report.seconds / run_s, 4),
        "measures_720p_frames_per_s": round(large_frames_per_second(), 1),
        "report": report.model_dump(),
    }
    text = json.dumps(row, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
