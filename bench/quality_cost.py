"""What the quality report costs the run it describes: its share of the run's wall time, and the run's tail.

    python bench/quality_cost.py [--frames 250] [--size 64] [--work DIR] [--out FILE]

Runs `k6vsr upscale` of a synthetic clip with the tiny random bundle on the CPU, as a user runs it (a command of its
own, in a fresh store, a private Prefect server under the work folder), timed by its wall clock. From the run's
timeline (`timeline.jsonl` in its store) it takes the report's work (the `quality` lines: each window's part and the
join after the mux, or, before the parts, the one measurement after the mux), and the end of the last decode; it
prints the report's busy seconds and their share of the run, the report's seconds after the last decode (what it
adds to the run's tail), and the tail itself (the last decode's end to the command's end). It also times the
measures alone on a 1280x720 output of a 640x360 source (frames in memory, decoding excluded), per frame, to compare
with the model's time per frame on a GPU. The load average is printed before and after: the host may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from k6vsr_core import UpscaleParams  # noqa: E402
from k6vsr_core.contract.plan import ModelTraits, make_plan  # noqa: E402
from k6vsr_core.contract.quality import QualityMeter, tile_borders  # noqa: E402


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


def timeline_costs(timeline: Path, ended: float) -> dict[str, float]:
    """The report's busy seconds, those after the last decode, and the tail, from a run's timeline."""
    lines = [json.loads(line) for line in timeline.read_text().splitlines() if line.strip()]
    last_decode = max(line["end"] for line in lines if line["stage"] == "decode")
    quality = [line for line in lines if line["stage"] == "quality"]
    return {
        "quality_s": round(sum(line["end"] - line["start"] for line in quality), 3),
        "quality_parts": len(quality),
        "quality_after_last_decode_s": round(
            sum(max(0.0, line["end"] - max(line["start"], last_decode)) for line in quality), 3
        ),
        "tail_s": round(ended - last_decode, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=250)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from bench.check_kit import tiny_inputs
    from flows.orchestrate import prefect_api
    from runtime.prefect_server import stop_server

    work, bundle, clip = tiny_inputs(args.work, "k6vsr-quality-bench-", args.frames, args.size)
    store = work / "run-store"
    shutil.rmtree(store, ignore_errors=True)
    home = work / "prefect"
    load_before = os.getloadavg()
    argv = ["upscale", str(clip), "-o", str(work), "--output-file-name", "out.mp4", "--store", str(store),
            "--scale", "2", "--model", str(bundle), "--json"]  # fmt: skip
    try:
        with prefect_api(home):  # exported to the command: it reports to it and starts no server of its own
            started = time.time()
            done = subprocess.run(
                [sys.executable, "-m", "entrypoints.cli", *argv], capture_output=True, text=True, cwd=ROOT
            )
            ended = time.time()
    finally:
        stop_server(home)
    if done.returncode != 0:
        raise SystemExit(f"k6vsr upscale failed: {done.stderr[-2000:]}")
    summary = json.loads(done.stdout)
    run_s = ended - started
    costs = timeline_costs(store / "runs" / summary["run_key"] / "timeline.jsonl", ended)
    row = {
        "frames": args.frames,
        "source": f"{args.size}x{args.size}",
        "windows": summary["windows"],
        "run_s": round(run_s, 2),
        **costs,
        "quality_share": round(costs["quality_s"] / run_s, 4),
        "quality_tail_share": round(costs["quality_after_last_decode_s"] / run_s, 4),
        "load_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "measures_720p_frames_per_s": round(large_frames_per_second(), 1),
        "report": summary["quality"],
    }
    text = json.dumps(row, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
