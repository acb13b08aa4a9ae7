"""What a job adds to its worker process's memory, against the server's estimate (`entrypoints.server.host_memory`).

    python bench/job_memory.py --port PORT --key KEY --model BUNDLE [--device cpu] WxHxFRAMES@SCALE ...

Against a running `k6vsr serve` on 127.0.0.1 (one worker, the same bundle and device): for each case, a synthetic clip
is made, uploaded and polled to its end while the resident memory of the job process (`server.child`, with its
children) is sampled every 50 ms; printed, one JSON line a case: its idle size before the job, its peak, the growth,
and `job_bytes` of the job's plan. Cases run one after another (each waits for its job).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from entrypoints.server.host_memory import computes_on_cpu, job_bytes  # noqa: E402
from k6vsr_core.contract.params import parse_params  # noqa: E402
from k6vsr_core.media.sample import make_sample_clip  # noqa: E402
from service.runs import ModelSpec, prepare_run  # noqa: E402


def job_process_rss() -> int:
    total = 0
    for process in psutil.process_iter(["cmdline"]):
        try:
            if "entrypoints.server.child" in " ".join(process.info["cmdline"] or []):
                total += process.memory_info().rss
        except psutil.Error:
            continue
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("cases", nargs="+", help="WxHxFRAMES@SCALE, e.g. 96x64x17@2")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="k6vsr-job-memory-"))
    spec = ModelSpec(model=args.model, device=args.device)
    client = httpx.Client(
        base_url=f"http://127.0.0.1:{args.port}", headers={"Authorization": f"Bearer {args.key}"}, timeout=120
    )
    for case in args.cases:
        size, scale = case.split("@")
        width, height, frames = (int(part) for part in size.split("x"))
        clip = make_sample_clip(work / f"{size}.mp4", width=width, height=height, num_frames=frames, audio=False)
        plan = prepare_run(clip, parse_params(scale=float(scale)), spec, work / "plans").plan
        idle = job_process_rss()
        files = {"video_reference": ("clip.mp4", clip.read_bytes(), "video/mp4")}
        fields = {"sr_resolution_scale": scale, "seed": str(time.time_ns() % 10**9)}
        response = client.post("/v1/videos", files=files, data=fields)
        if response.status_code != 200:
            print(json.dumps({"case": case, "status": response.status_code, "error": response.json()["error"]}))
            continue
        job_id, peak, started = response.json()["id"], idle, time.monotonic()
        while (status := client.get(f"/v1/videos/{job_id}").json()["status"]) not in ("completed", "failed"):
            for _ in range(10):
                peak = max(peak, job_process_rss())
                time.sleep(0.05)
        row = {
            "case": case,
            "status": status,
            "tiles": plan.num_tiles,
            "window_frames": plan.window_frames,
            "seconds": round(time.monotonic() - started, 1),
            "idle_mb": idle >> 20,
            "peak_mb": peak >> 20,
            "growth_mb": (peak - idle) >> 20,
            "estimate_mb": job_bytes(plan, computes_on_cpu(args.device)) >> 20,
        }
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
