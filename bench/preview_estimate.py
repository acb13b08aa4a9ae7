"""How close `k6vsr preview`'s estimate comes to the whole run it estimates.

    python bench/preview_estimate.py [--frames 250] [--size 64] [--windows 1] [--work DIR] [--out FILE]

With the tiny random bundle on the CPU: a preview of `--windows` windows of a synthetic clip in one store (its
estimate of the whole run from nothing), then the whole run of the same clip in a fresh store, timed by its wall
clock, and the two compared. A private Prefect server under the work folder is started for the runs and stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=250)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--windows", type=int, default=1)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from flows.orchestrate import prefect_api, run_clip
    from flows.prefect_server import stop_server
    from flows.preview import preview_clip
    from k6vsr_core.bundle import make_tiny_bundle
    from k6vsr_core.params import UpscaleParams
    from k6vsr_core.sample import make_sample_clip
    from service.runs import ModelSpec, prepare_run

    work = (args.work or Path(tempfile.mkdtemp(prefix="k6vsr-preview-bench-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    bundle = work / "tiny-bundle"
    if not (bundle / "model_index.json").is_file():
        make_tiny_bundle(bundle)
    model = ModelSpec(model=str(bundle), device="cpu")
    params = UpscaleParams(scale=2)
    clip = work / f"clip-{args.frames}.mp4"
    if not clip.is_file():
        make_sample_clip(clip, width=args.size, height=args.size, num_frames=args.frames, fps=24)
    home = work / "prefect"
    try:
        with prefect_api(home):
            warm = make_sample_clip(work / "warm.mp4", width=args.size, height=args.size, num_frames=1)
            run_clip(prepare_run(warm, params, model, work / "warm-store"), str(work / "warm-out.mp4"), model)
            started = time.perf_counter()
            preview = preview_clip(
                prepared=prepare_run(clip, params, model, work / "preview-store"),
                model=model,
                count=args.windows,
                out_dir=str(work),
            )
            preview_s = time.perf_counter() - started
            started = time.perf_counter()
            summary = run_clip(prepare_run(clip, params, model, work / "run-store"), str(work / "out.mp4"), model)
            run_s = time.perf_counter() - started
    finally:
        stop_server(home)
    estimate = preview.estimate
    assert estimate is not None
    row = {
        "frames": args.frames,
        "windows": summary.windows,
        "previewed": preview.windows,
        "preview_s": round(preview_s, 1),
        "estimate_s": estimate.seconds,
        "run_s": round(run_s, 1),
        "error": round(estimate.seconds / run_s - 1, 3),
        "estimate_output_bytes": estimate.output_bytes,
        "output_bytes": (work / "out.mp4").stat().st_size,
        "rates": preview.rates.model_dump() if preview.rates else None,
    }
    text = json.dumps(row, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
