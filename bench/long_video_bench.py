"""W4: a whole minute of video through the real `k6vsr upscale` command, with the store, host and GPU watched.

    python bench/long_video_bench.py --work DIR --out DIR [--label NAME] [--seconds 60] [--timeout S] [-- k6vsr flags]

W4 is W1's geometry (768x512, x2, 9 tiles a window) for `--seconds` of 24 fps video with a stereo tone: 1440 frames
in 14 windows for a minute. The full released architecture with random weights is written once under `--work`
(see run_bench.py), the clip too. The command runs as users run it; beside it, every 2 s, this script samples:

- the run store's size on disk (its peak is what `plan` estimates),
- the resident memory of the command and every process below it,
- the GPU memory in use (NVML through `nvidia-smi`).

A run that does not finish within `--timeout` is killed (SIGKILL, as a preempted machine would); run the script
again with the same `--work` and the command resumes from the store. Each call appends its samples, the command's
summary and the per-window finish times (from the store's records) to `<work>/<label>.json`, copied to `<out>`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SAMPLE_S = 2.0
WIDTH, HEIGHT, FPS = 768, 512, 24


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry.name))
            rss[int(entry.name)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        total += rss.get(current, 0)
        stack.extend(children.get(current, []))
    return total


def folder_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except OSError:
                pass
    return total


def gpu_used_bytes() -> list[int]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        return [int(line) * 2**20 for line in out.split()]
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return []


def window_finish_times(store: Path) -> dict[str, float]:
    """When each window's segment was recorded (seconds since the epoch)."""
    times = {}
    for runs in (store / "runs").glob("*"):
        for record in (runs / "done" / "segment").glob("*.json"):
            times[record.stem] = json.loads(record.read_text())["written_at"]
    return dict(sorted(times.items(), key=lambda item: int(item[0])))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--timeout", type=float, default=540.0)
    parser.add_argument("--label", default="w4", help="names this run's store, output and history under --work")
    parser.add_argument("--setup-only", action="store_true", help="write the bundle and the clip, run nothing")
    parser.add_argument("extra", nargs="*", help="more k6vsr upscale flags (after --)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    from bench import run_bench
    from k6vsr_core.media.sample import make_sample_clip

    bundle = args.work / "bundle"
    if not (bundle / "model_index.json").is_file():
        run_bench.write_full_bundle(bundle, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    clip = args.work / f"w4-{args.seconds}s.mp4"
    if not clip.is_file():
        make_sample_clip(clip.with_suffix(".part.mp4"), width=WIDTH, height=HEIGHT, num_frames=args.seconds * FPS)
        clip.with_suffix(".part.mp4").rename(clip)
    if args.setup_only:
        return 0
    store, out_dir = args.work / f"store-{args.label}", args.work / f"out-{args.label}"
    argv = [
        sys.executable, "-m", "entrypoints.cli", "upscale", str(clip), "--scale", "2", "--model", str(bundle),
        "--store", str(store), "-o", str(out_dir), "--output-file-name", "w4.mp4", "--json", *args.extra,
    ]  # fmt: skip
    samples: list[dict[str, Any]] = []
    started = time.time()
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(SAMPLE_S):
            samples.append(
                {
                    "t": round(time.time() - started, 1),
                    "store_bytes": folder_bytes(store),
                    "rss_bytes": tree_rss(process.pid),
                    "gpu_bytes": gpu_used_bytes(),
                }
            )

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        stdout, stderr = process.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.kill(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
    stop.set()
    sampler.join()
    seconds = time.time() - started
    result = {
        "command": argv,
        "started_at": started,
        "seconds": round(seconds, 1),
        "returncode": process.returncode,
        "summary": json.loads(stdout) if process.returncode == 0 else None,
        "stderr_tail": stderr[-3000:],
        "windows_finished_at": window_finish_times(store),
        "peak": {
            "store_bytes": max((s["store_bytes"] for s in samples), default=0),
            "rss_bytes": max((s["rss_bytes"] for s in samples), default=0),
            "gpu_bytes": max((max(s["gpu_bytes"], default=0) for s in samples), default=0),
        },
        "final_store_bytes": folder_bytes(store),
        "output_bytes": (out_dir / "w4.mp4").stat().st_size if (out_dir / "w4.mp4").is_file() else None,
        "samples": samples,
    }
    # The history lives beside the store, so that a resumed call adds to the killed one's.
    history = args.work / f"{args.label}.json"
    calls = json.loads(history.read_text()) if history.is_file() else []
    history.write_text(json.dumps([*calls, result], indent=1))
    (args.out / history.name).write_text(history.read_text())
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1)[-6000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
