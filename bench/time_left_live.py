"""The `k6vsr upscale` bar's time left, seen live on a pseudo-terminal, against when the run really ended.

    python bench/time_left_live.py --work /tmp/tl --out /tmp/tl-out [--kill-at 300] [--size 128x96 --frames 250]

Runs the command on the tiny random bundle (CPU) on a 160x40 pseudo-terminal and reads each `MM:SS left` its bar
draws, with the second it was drawn. With `--kill-at S` the command is SIGKILLed (its whole process group, as a
preempted machine would) S seconds after it started, and the same command is run again: the resumed run's figures
are checked against the resumed run's end. Every figure is checked against the issue's bounds (#50 item 3: within
20 % while two minutes or more are left, within 20 s in the last two minutes, a figure within 30 s of a resumed run's
start). Writes `report.json` (each figure, each miss) and the run's `timeline.jsonl` into `--out`, the latter for
the replay tests (`tests/flows/test_progress.py`).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import re
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LEFT = re.compile(r"(?:(\d+):)?(\d\d):(\d\d) left")


def _seconds(match: re.Match[str]) -> int:
    hours, minutes, seconds = (int(part or 0) for part in match.groups())
    return 3600 * hours + 60 * minutes + seconds


def on_a_terminal(argv: list[str], env: dict[str, str], kill_at: float | None) -> tuple[float, list[tuple[float, int]]]:
    """Run `argv` on a pseudo-terminal until it ends (or `kill_at` seconds); its wall seconds and each time-left
    figure its bar drew, as (seconds since start, seconds left shown)."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    started = time.monotonic()
    process = subprocess.Popen(argv, stdin=child, stdout=child, stderr=child, env=env, cwd=ROOT, start_new_session=True)
    os.close(child)
    figures: list[tuple[float, int]] = []
    pending, tail = "", []
    try:
        while True:
            if kill_at is not None and time.monotonic() - started >= kill_at:
                os.killpg(process.pid, signal.SIGKILL)
                break
            try:
                chunk = os.read(main, 65536)
            except OSError:
                break
            if not chunk:
                break
            pending += chunk.decode(errors="replace")
            *lines, pending = re.split(r"[\r\n]", pending)
            now = time.monotonic() - started
            for line in lines:
                tail = [*tail[-20:], line]
                if match := LEFT.search(line):
                    figures.append((now, _seconds(match)))
        code = process.wait(timeout=60)
    finally:
        os.close(main)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    if kill_at is None and code != 0:
        raise SystemExit(f"the command failed ({code}):\n" + "\n".join(tail))
    return time.monotonic() - started, figures


def misses(figures: list[tuple[float, int]], wall: float) -> list[tuple[float, float, int]]:
    """The figures off by more than the bounds: (when, seconds really left, seconds shown)."""
    out = []
    for at, shown in figures:
        actual = wall - at
        if abs(shown - actual) > (0.2 * actual if actual >= 120 else 20.0):
            out.append((round(at, 1), round(actual, 1), shown))
    return out


def normalized(timeline: str) -> str:
    """A run's timeline as the replay tests keep it: stage, item, start and end in seconds from its first line's
    start, and its attempts numbered 0, 1, ... in the order they began."""
    lines = [json.loads(line) for line in timeline.splitlines() if line.strip()]
    origin = min(line["start"] for line in lines)
    attempts: dict[str, int] = {}
    out = []
    for line in sorted(lines, key=lambda line: line["end"]):
        number = attempts.setdefault(line.get("attempt") or str(line.get("pid")), len(attempts))
        start, end = round(line["start"] - origin, 2), round(line["end"] - origin, 2)
        out.append({"stage": line["stage"], "item": line["item"], "start": start, "end": end, "attempt": number})
    return "".join(json.dumps(line) + "\n" for line in out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", default="128x96", help="WIDTHxHEIGHT of the sample clip")
    parser.add_argument("--frames", type=int, default=250)
    parser.add_argument("--kill-at", type=float, default=None, help="SIGKILL the first command after these seconds")
    args = parser.parse_args()

    from k6vsr_core.media.sample import make_sample_clip
    from k6vsr_core.model.tiny_bundle import make_tiny_bundle

    width, height = (int(part) for part in args.size.split("x"))
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    clip = make_sample_clip(args.work / "clip.mp4", width=width, height=height, num_frames=args.frames)
    bundle = make_tiny_bundle(args.work / "tiny")
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    env.update(
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        K6VSR_STATE_HOME=str(args.work / "state"),
        K6VSR_SERVER_PORT="0",
        PREFECT_HOME=str(args.work / "prefect-home"),
    )
    store = args.work / "store"
    argv = [sys.executable, "-m", "entrypoints.cli", "upscale", str(clip), "-o", str(args.work / "out")]
    argv += ["--scale", "2", "--model", str(bundle), "--device", "cpu", "--store", str(store)]
    report: dict[str, object] = {"size": args.size, "frames": args.frames, "load_before": os.getloadavg()}
    attempts = []
    try:
        if args.kill_at is not None:
            wall, figures = on_a_terminal(argv, env, args.kill_at)
            attempts.append({"killed_at": wall, "figures": figures})
        wall, figures = on_a_terminal(argv, env, None)
        first = figures[0][0] if figures else None
        attempts.append({"wall": wall, "figures": figures, "first_figure_at": first, "misses": misses(figures, wall)})
    finally:
        subprocess.run([sys.executable, "-m", "entrypoints.cli", "server", "stop"], env=env, cwd=ROOT, check=False)
    report.update(attempts=attempts, load_after=os.getloadavg())
    (run,) = (store / "runs").iterdir()
    (args.out / "timeline.jsonl").write_text(normalized((run / "timeline.jsonl").read_text()))
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    last = attempts[-1]
    print(
        f"wall {last['wall']:.1f} s, first figure at {last['first_figure_at']}, {len(last['figures'])} figures, "
        f"{len(last['misses'])} misses: {last['misses'][:10]}"
    )
    return 1 if last["misses"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
