"""How busy an archive keeps the model lane, on the CPU, with the bench-only stand-in for the networks.

    python bench/model_lane.py [--clips 4] [--windows 2] [--size 128x128] [--ms 300] [--lanes threads,processes]

Runs the real `k6vsr archive` command on N synthetic clips (the tiny random bundle, `--device cpu`) once per lane
layout (`K6VSR_LANES`: `threads`, the command computing in its own threads; `processes`, the cluster a GPU machine's
command starts for itself: one model process that only computes and CPU-lane processes), with the stand-in
(`bench/fake_model.py`: each network call holds its process's one "device" for a fixed time, as a GPU would). From
the runs' timelines it reports, per layout:

- the wall time of the command, the head (command start to the first model item) and the tail (last model item to
  the command's end);
- the model span (first model item's start to the last one's end), the device's busy time in it (calls x ms: the
  calls take turns) and the share of the span it fills, and the union of the model items' spans;
- which processes ran each stage (the model process must run model items alone).

The stand-in sleeps, so it shows where the orchestration leaves the device waiting, not what a CPU stage's GIL
costs a GPU process: that needs the GPU (bench/device_check.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench import fake_model  # noqa: E402 - after the path
from tests.timelines import MODEL_STAGES, covered  # noqa: E402 - after the path


def measure(work: Path, layout: str, args: argparse.Namespace) -> dict[str, object]:
    env = dict(os.environ)
    env |= {
        **fake_model.environment(args.ms),
        "K6VSR_LANES": layout,
        "K6VSR_WARM_WORKERS": "off",
    }
    store, out = work / f"store-{layout}", work / f"out-{layout}"
    command = [sys.executable, "-m", "entrypoints.cli", "archive", str(work / "in"), "-o", str(out)]
    command += ["--model", str(work / "bundle"), "--device", "cpu", "--scale", "2", "--store", str(store), "--json"]
    started = time.time()
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    ended = time.time()
    if done.returncode:
        raise SystemExit(f"{layout}: the archive failed ({done.returncode}):\n{done.stderr[-3000:]}")
    lines = [json.loads(line) for f in store.rglob("timeline.jsonl") for line in f.read_text().splitlines()]
    model = [(line["start"], line["end"]) for line in lines if line["stage"] in MODEL_STAGES]
    first, last = min(s for s, _ in model), max(e for _, e in model)
    span = last - first
    busy = len(model) * args.ms / 1000
    pids: dict[str, list[int]] = {}
    for line in lines:
        pids.setdefault(line["stage"], [])
        if line["pid"] not in pids[line["stage"]]:
            pids[line["stage"]].append(line["pid"])
    return {
        "layout": layout,
        "wall_s": round(ended - started, 2),
        "head_s": round(first - started, 2),
        "tail_s": round(ended - last, 2),
        "model_items": len(model),
        "model_span_s": round(span, 2),
        "device_busy_s": round(busy, 2),
        "device_share": round(busy / span, 3),
        "items_cover": round(covered(model) / span, 3),
        "pids": pids,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clips", type=int, default=4)
    parser.add_argument("--windows", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--size", default="128x128")
    parser.add_argument("--ms", type=float, default=300.0)
    parser.add_argument("--lanes", default="threads,processes")
    args = parser.parse_args()
    from archive_scale import make_clips

    from k6vsr_core.model.tiny_bundle import make_tiny_bundle

    width, height = (int(v) for v in args.size.split("x"))
    with tempfile.TemporaryDirectory(prefix="k6vsr-model-lane-") as folder:
        work = Path(folder)
        make_clips(work / "in", args.clips, windows_each=args.windows, size=(width, height))
        make_tiny_bundle(work / "bundle")
        rows = [measure(work, layout, args) for layout in args.lanes.split(",")]
    print(json.dumps(rows, indent=1))
    print("\n| layout | wall s | head s | tail s | model span s | device busy s | share | items cover |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['layout']} | {r['wall_s']} | {r['head_s']} | {r['tail_s']} | {r['model_span_s']} | "
            f"{r['device_busy_s']} | {r['device_share']} | {r['items_cover']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
