"""How close `k6vsr preview`'s estimate comes to the whole run it estimates.

    python bench/preview_estimate.py [--frames 250] [--size 64] [--windows 1] [--work DIR] [--out FILE]

With the tiny random bundle on the CPU, as a user runs them: `k6vsr preview --windows N` of a synthetic clip in
one store (its estimate of the whole run from nothing), then `k6vsr upscale` of the same clip in a fresh store, each
a command of its own, the second timed by its wall clock; the two are compared. A private Prefect server under the
work folder is started for the commands and stopped. The one-minute load average is printed before, between and
after: on a shared host, other processes change both times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _command(argv: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-m", "entrypoints.cli", *argv], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"k6vsr {argv[0]} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=250)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--windows", type=int, default=1)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from bench.check_kit import tiny_inputs
    from flows.orchestrate import prefect_api
    from runtime.prefect_server import stop_server

    work, bundle, clip = tiny_inputs(args.work, "k6vsr-preview-bench-", args.frames, args.size)
    common = ["--scale", "2", "--model", str(bundle), "--json"]
    home = work / "prefect"
    load_before = os.getloadavg()[0]
    try:
        with prefect_api(home):  # exported to the commands: they report to it and start no server of their own
            started = time.perf_counter()
            preview = _command(["preview", str(clip), "--windows", str(args.windows), "-o", str(work),
                                "--store", str(work / "preview-store"), *common])  # fmt: skip
            preview_s = time.perf_counter() - started
            load_between = os.getloadavg()[0]
            started = time.perf_counter()
            summary = _command(["upscale", str(clip), "-o", str(work), "--output-file-name", "out.mp4",
                                "--store", str(work / "run-store"), *common])  # fmt: skip
            run_s = time.perf_counter() - started
            load_after = os.getloadavg()[0]
    finally:
        stop_server(home)
    estimate = preview["estimate"]
    row = {
        "frames": args.frames,
        "windows": summary["windows"],
        "previewed": preview["windows"],
        "preview_s": round(preview_s, 1),
        "estimate_s": estimate["seconds"],
        "run_s": round(run_s, 1),
        "error": round(estimate["seconds"] / run_s - 1, 3),
        "estimate_output_bytes": estimate["output_bytes"],
        "output_bytes": (work / "out.mp4").stat().st_size,
        "rates": preview["rates"],
        "load_before_between_after": [round(load_before, 2), round(load_between, 2), round(load_after, 2)],
    }
    text = json.dumps(row, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
