"""The device check: the README's GPU command, as the README writes it, on a GPU machine, measured.

One call of at most 9 minutes on a fresh GPU machine (see bench/README.md, "Device check"):

1. writes the full-size random-weight bundle in the released layout and the W1 and W2 clips (once per machine);
2. optionally imports a compile cache (`k6vsr cache import`), or wipes the machine's compile cache and imports the
   file the same call exported (`--reimport`: a fresh machine's first run with an imported cache);
3. runs the README's GPU command, taken from README.md, with `K6VSR_MODEL` pointing at the bundle: on W1 (cold or
   imported cache), W2, then again with warm workers (`k6vsr workers start --model ...`, first and second run,
   `k6vsr workers stop`), each run with a store of its own so that nothing is reused (and, as `--runs` asks, the
   in-memory runner, a three-window clip and an archive: below);
4. prints and writes (`--out`) a table: wall time, the stage timeline (first start and last end of each stage, from
   the run's `timeline.jsonl`), peak GPU memory (the processes' own `max_memory_reserved` and NVML's device-wide
   figure, sampled every 0.1 s), the output's md5, the compile notices, and pass or fail against the open GPU
   issues' targets.

`--runs inmemory,multiwindow,archive` are the streaming issue's runs (`bench/streaming.py`): the in-memory runner on
W1 in a process of its own (a first and a hot run, with its per-stage busy seconds and GPU work), a clip of three
windows through the README's command (seconds per window), and an archive of `--archive-clips` W1 clips through
`k6vsr archive` (clips per hour), each judged against the in-memory runner of the same call, as are the warm
workers and the warm one-shot:

    python3 bench/device_check.py --runs inmemory,warm,workers --deadline 540
    python3 bench/device_check.py --runs inmemory,multiwindow,archive --archive-clips 4 --deadline 540

`--runs preview` is the estimate issue's (`bench/preview_check.py`): `k6vsr preview --windows 1` of the three-window
clip, then the README's command on the preview's store (it computes the other two windows); the preview's estimate
of what was left against the run's wall time, output bytes and peak store size, within 25 % for the time:

    python3 bench/device_check.py --runs preview --deadline 540

`--runs same-bytes` is the determinism check (`bench/same_bytes.py`): one clip through two one-shot runs, warm
workers, `--gpus` where there are several, three runs killed and resumed, and the in-memory runner with and without
the kernel settings; one md5 expected, and the cost of determinism timed.

`--runs memory` is the memory issue's (`bench/memory_bench.py` on the check's bundle, one process each): the default
budget and its whole-tile-decode reference, then `auto` on cards of 48, 24 and 16 GiB simulated by the process's
memory fraction; each mode's peak against its cap, the default's time against the whole-tile decode and the smaller
cards' against the default:

    python3 bench/device_check.py --runs memory --deadline 560

`--runs two-gpus` is the two-GPU issue's (`bench/two_gpus.py`): warm workers on the first GPU only
(`CUDA_VISIBLE_DEVICES`), then one per visible GPU, each set running the `--two-gpu-parts` asked: W1 twice, the
three-window clip, an archive of `--archive-clips` W1 clips, and (all GPUs) W1 with one worker SIGKILLed mid-tile;
W1 and the window at most 0.55x one GPU, clips per hour at least 1.9x, the killed run with one GPU's md5. With fewer
than 2 GPUs one row says so. One call holds one of these (a bundle and a warm compile cache already there):

    python3 bench/device_check.py --runs two-gpus --two-gpu-parts w1,kill --deadline 560
    python3 bench/device_check.py --runs two-gpus --two-gpu-parts multiwindow --deadline 560
    python3 bench/device_check.py --runs two-gpus --two-gpu-parts archive --archive-clips 4 --archive-max-parallel 2 \\
        --deadline 560

Runs that would not finish before `--deadline` are skipped and listed. Later GPU issues add their runs here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import preview_check, same_bytes, streaming, two_gpus  # noqa: E402 - after the checkout is on the path, as for a script
from bench.check_kit import (  # noqa: E402
    COST,
    ROOT,
    as_run,
    md5,
    readme_gpu_command,
    timeline_lines,
)
from k6vsr_core.contract.stage_names import MODEL_STAGES  # noqa: E402

# W1-long: W1's size for three windows (121 + 2 x 105 frames: the window stride at the default overlap of 16).
WORKLOADS = {"W1": (768, 512, 121), "W2": (384, 256, 33), "W1-long": (768, 512, 331)}
# `--tiny`: the same runs on the CPU with the tiny random bundle and small clips (a smoke test of this script); the
# windows are 121 frames whatever the model, so W1-long keeps its length, on one tile.
TINY_WORKLOADS = {"W1": (96, 64, 9), "W2": (64, 64, 9), "W1-long": (64, 64, 331)}
# The memory issue's modes (bench/memory_bench.py): the default, its whole-tile-decode reference, `auto` on smaller
# cards simulated by the process's memory fraction.
MEMORY_MODES = "default,fast-whole,auto48,auto24,auto16"
TIMED_OUT = 124  # a command's exit code in the table when the check's deadline cut it, as `timeout` says it
# Targets of the open GPU issues this check measures (ratios against runs of the same call).
TARGETS = {
    "peak_reserved_gib": 32.0,  # GPU memory budget at defaults, W1 (memory issue)
    # The streaming issue's (bench/streaming.py):
    "workers_vs_inmemory": 1.05,  # warm workers W1, first and second run, at most 1.05x the in-memory runner hot
    "inmemory_over_gpu_work_s": 3.0,  # in-memory W1 hot at most its GPU work (encode + denoise + decode) + 3 s
    "warm_oneshot_over_inmemory_s": 15.0,  # one-shot W1 with a warm compile cache at most in-memory hot + 15 s
    "window_vs_gpu_work": 1.05,  # multi-window GPU stream's seconds a window at most 1.05x one window's GPU work
    "archive_vs_serial_inmemory": 1.15,  # archive clips per hour at least 1.15x in-memory hot runs one after another
    # The archive issue's (#33): the GPU never waits.
    "archive_vs_gpu_work": 0.9,  # archive clips per hour at least 0.9x 3600 / one clip's GPU work
    "workers_head_s": 5.0,  # warm workers: the command's start to its first GPU item
    "oneshot_head_s": 15.0,  # one-shot with a warm compile cache: likewise
    "tail_s": 5.0,  # the last GPU item's end to the command's end
    # The two-GPU issue's (bench/two_gpus.py), all visible GPUs against the first one alone, warm workers both:
    "two_gpus_w1_vs_one": 0.55,  # W1, second run, at most 0.55x
    "two_gpus_window_vs_one": 0.55,  # multi-window seconds per window at most 0.55x
    "two_gpus_archive_vs_one": 1.9,  # archive clips per hour at least 1.9x
    # The scene issue's (#51, bench/preview_check.py): the preview's estimate of the run after it within 15 %.
    "preview_estimate_error": 0.15,
}


class NvmlPeak:
    """Used memory of every GPU, sampled every 0.1 s while a run lasts (NVML sees every process on a GPU); `gib` is
    the largest card's peak, what a per-card budget is judged by, and `per_gpu` each card's."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no NVML: the column stays empty
            self._nvml = None

    def __enter__(self) -> NvmlPeak:
        self.peaks = [0] * len(self._handles) if self._nvml is not None else []
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while self._nvml is not None and not self._stop.wait(0.1):
            for index, handle in enumerate(self._handles):
                self.peaks[index] = max(self.peaks[index], self._nvml.nvmlDeviceGetMemoryInfo(handle).used)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def gib(self) -> float | None:
        return round(max(self.peaks) / 2**30, 2) if self.peaks else None

    @property
    def per_gpu(self) -> list[float]:
        return [round(peak / 2**30, 2) for peak in self.peaks]


def timeline(store: Path, started: float) -> tuple[dict[str, list[float]], float | None]:
    """Per stage: [first start, last end, tasks] in seconds from the command's start; the largest process peak. The
    items of earlier commands on the same store (a preview's windows, a killed run's tasks) are not the command's."""
    stages: dict[str, list[float]] = {}
    peak = None
    for row in timeline_lines(store):
        if row["end"] < started:
            continue
        span = stages.setdefault(row["stage"], [row["start"] - started, row["end"] - started, 0])
        span[0] = min(span[0], row["start"] - started)
        span[1] = max(span[1], row["end"] - started)
        span[2] += 1
        if row.get("cuda_peak_gib") is not None:
            peak = max(peak or 0.0, row["cuda_peak_gib"])
    return {k: [round(v[0], 1), round(v[1], 1), int(v[2])] for k, v in stages.items()}, peak


# The command's compile lines (`k6vsr_core.device.compile_cache`): a shape's first compile on the machine, and a
# compile of
# a shape the machine or the process had run before.
COMPILE_LINES = ("compiling GPU kernels for the ", " ran this shape before: ")


def compile_notices(stderr: str) -> int:
    """How many compile lines the command printed, of either kind."""
    return sum(any(mark in line for mark in COMPILE_LINES) for line in stderr.splitlines())


def head_and_tail(stages: dict[str, list[float]], wall: float) -> dict[str, float | None]:
    """Seconds from the command's start to its first GPU item (`head_s`), and from its last GPU item's end to the
    command's end (`tail_s`), from the stage spans of `timeline`."""
    gpu = [stages[stage] for stage in MODEL_STAGES if stage in stages]
    if not gpu:
        return {"head_s": None, "tail_s": None}
    return {"head_s": round(min(s[0] for s in gpu), 1), "tail_s": round(wall - max(s[1] for s in gpu), 1)}


def stage_checksums(store: Path) -> dict[str, str]:
    """Per stage, a short digest of its items' completion checksums (the records outlive the data they describe):
    two runs whose outputs differ show at which stage they parted."""
    sums = {}
    for run in store.glob("runs/*/done"):
        for stage in sorted(path for path in run.iterdir() if path.is_dir()):
            items = sorted(
                f"{path.stem}:{json.loads(path.read_text()).get('checksum', '')}" for path in stage.glob("*.json")
            )
            sums[stage.name] = hashlib.sha1("\n".join(items).encode()).hexdigest()[:8]
    return sums


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.work)
        self.out = Path(args.out)
        self.deadline = time.monotonic() + args.deadline
        self.rows: list[dict[str, Any]] = []
        self._lock = threading.RLock()  # the same-bytes runs add rows from several threads
        self.memory_targets: dict[str, Any] = {}  # bench/memory_bench.py's checks, when `memory` ran
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "K6VSR_MODEL": str(self.work / "bundle"),
            "K6VSR_STATE_HOME": str(self.work / "home"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }

    def fits(self, key: str, times: int = 1) -> bool:
        return time.monotonic() + COST[key] * times < self.deadline

    def log(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    def command(self, label: str, argv: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
        """Run one command; its wall time, exit code and the tail of its output."""
        self.log(f"{label}: {shlex.join(argv[2:] if argv[0] == sys.executable else argv)}")
        started = time.time()
        try:
            done = subprocess.run(
                argv, env=env or self.env, cwd=self.work, capture_output=True, text=True, timeout=max(30, self.left())
            )
            rc, stdout, stderr = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as expired:
            # Cut at the deadline: the row says so and the check goes on to stop what it started and write the table.
            rc, stdout = TIMED_OUT, _text(expired.stdout)
            stderr = _text(expired.stderr) + f"\ncut at the check's deadline after {time.time() - started:.0f} s"
        wall = time.time() - started
        (self.out / f"{label}.log").write_text(stdout + "\n--- stderr ---\n" + stderr)
        self.log(f"{label}: exit {rc} in {wall:.1f} s")
        return {"label": label, "wall_s": round(wall, 1), "rc": rc, "stdout": stdout, "stderr": stderr}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def upscale(
        self,
        label: str,
        workload: str,
        note: str,
        *,
        extra_env: dict[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
        run: str | None = None,
        fresh: bool = True,
        wrap: Callable[[list[str]], list[str]] | None = None,
        group: str | None = None,
    ) -> dict[str, Any]:
        """The README's GPU command on `workload`, with a store and an output folder of its own (`run`'s, shared by
        the steps of a kill and its resume; emptied first when `fresh`), `extra_args` added and `wrap` around it
        (the fault harness); the row for the table."""
        store = self.work / f"store-{run or label}"
        out_dir = self.work / f"out-{run or label}"
        if fresh:
            shutil.rmtree(store, ignore_errors=True)
            shutil.rmtree(out_dir, ignore_errors=True)
        argv = [*as_run(readme_gpu_command(), self.clip(workload), out_dir), *extra_args]
        if wrap is not None:
            argv = wrap(argv)
        return self.measure(label, workload, note, argv, extra_env or {}, store, out_dir, group)

    def measure(
        self,
        label: str,
        workload: str,
        note: str,
        argv: list[str],
        extra_env: dict[str, str],
        store: Path,
        out_dir: Path,
        group: str | None = None,
        add: bool = True,
        stdout: bool = False,
    ) -> dict[str, Any]:
        """Run `argv` on `store` (`K6VSR_STORE`) with NVML's device peak sampled; the row for the table (added to it
        unless `add` is false: the caller adds its own figures first), from its exit, the store's timeline and the
        newest MP4 in `out_dir`; with `stdout`, the command's stdout under that key (for the caller to read and
        drop)."""
        env = {**self.env, **extra_env, "K6VSR_STORE": str(store)}
        started = time.time()
        with NvmlPeak() as nvml:
            result = self.command(label, argv, env)
        stages, process_peak = timeline(store, started)
        outputs = sorted(out_dir.glob("*.mp4"))
        row = {
            "run": label,
            "workload": workload,
            "note": note,
            "wall_s": result["wall_s"],
            "rc": result["rc"],
            "stages": stages,
            **head_and_tail(stages, result["wall_s"]),
            "peak_reserved_gib": process_peak,
            "nvml_peak_gib": nvml.gib,
            "nvml_peak_gib_per_gpu": nvml.per_gpu,
            "md5": md5(outputs[-1]) if outputs else None,
            "compile_notices": compile_notices(result["stderr"]),
            "stage_sums": stage_checksums(store),
            "error": None if result["rc"] == 0 else result["stderr"].strip().splitlines()[-1:],
        }
        if group is not None:
            row["group"] = group
        if stdout:
            row["stdout"] = result["stdout"]
        if add:
            self.add_row(row)
        return row

    def reuse(self, earlier: Path) -> None:
        """The in-memory rows of an earlier call on this machine, as this call's reference."""
        rows = json.loads(earlier.read_text())["rows"]
        for row in rows:
            if str(row.get("run", "")).startswith(streaming.INMEMORY):
                self.add_row({**row, "note": f"{row.get('note', '')} (from the earlier call {earlier})"})

    def add_row(self, row: dict[str, Any]) -> None:
        with self._lock:
            self.rows.append(row)
            self.save()

    @property
    def workloads(self) -> dict[str, tuple[int, int, int]]:
        return TINY_WORKLOADS if self.args.tiny else WORKLOADS

    def clip(self, workload: str) -> Path:
        width, height, frames = self.workloads[workload]
        path = self.work / f"clip-{workload}.mp4"
        if not path.exists():
            from k6vsr_core.media.sample import make_sample_clip

            make_sample_clip(path.with_suffix(".part.mp4"), width=width, height=height, num_frames=frames, fps=24)
            path.with_suffix(".part.mp4").rename(path)
        return path

    def bundle(self) -> None:
        if (self.work / "bundle" / "model_index.json").exists():
            return
        if self.args.tiny:
            from k6vsr_core.model.tiny_bundle import make_tiny_bundle

            make_tiny_bundle(self.work / "bundle")
            return
        import torch

        from bench.run_bench import write_full_bundle

        started = time.time()
        info = write_full_bundle(self.work / "bundle", torch.device("cuda"))
        self.rows.append({"run": "write bundle", "wall_s": round(time.time() - started, 1), "note": str(info)})
        torch.cuda.empty_cache()

    def cli(self, label: str, *args: str) -> dict[str, Any]:
        result = self.command(label, [sys.executable, "-m", "entrypoints.cli", *args])
        self.add_row({"run": label, "wall_s": result["wall_s"], "rc": result["rc"], "note": " ".join(args)})
        return result

    def save(self) -> None:
        with self._lock:
            (self.out / "device-check.json").write_text(
                json.dumps({"rows": self.rows, "verdicts": self.verdicts()}, indent=2)
            )
            (self.out / "device-check.md").write_text(self.render())

    def verdicts(self) -> list[dict[str, Any]]:
        runs = {row["run"]: row for row in self.rows if "workload" in row}
        verdicts = []
        for row in runs.values():
            if "fired" in row:
                continue  # killed on purpose: its verdict is the same-bytes set's
            verdicts.append({"target": f"{row['run']} completes", "measured": row["rc"], "pass": row["rc"] == 0})
            if row["workload"] == "W1" and row.get("peak_reserved_gib") is not None:
                goal = TARGETS["peak_reserved_gib"]
                verdicts.append(
                    {
                        "target": f"{row['run']}: peak reserved <= {goal} GiB",
                        "measured": row["peak_reserved_gib"],
                        "pass": row["peak_reserved_gib"] <= goal,
                    }
                )
        w1 = [row for row in runs.values() if row["workload"] == "W1" and row["md5"] and "group" not in row]
        if len(w1) > 1:
            same = len({row["md5"] for row in w1}) == 1
            verdicts.append(
                {"target": "W1: one md5 for every process", "measured": len({r["md5"] for r in w1}), "pass": same}
            )
        memory = memory_verdicts(self.memory_targets, self.rows)
        found = streaming.verdicts(self.rows, TARGETS) + same_bytes.verdicts(self.rows) + memory
        if any(str(row.get("run", "")).startswith(preview_check.PREVIEW) for row in self.rows):
            found += preview_check.verdicts(self.rows, TARGETS)
        if any(row.get("group") == two_gpus.GROUP for row in self.rows):
            found += two_gpus.verdicts(self.rows, TARGETS)
        return verdicts + found

    def render(self) -> str:
        lines = [
            "| run | workload | wall s | rc | stages: first start-last end s (tasks) | peak reserved GiB "
            "| NVML peak GiB | md5 | stage checksums | compile notices | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in self.rows:
            stages = "; ".join(f"{k} {v[0]}-{v[1]} ({v[2]})" for k, v in row.get("stages", {}).items())
            lines.append(
                f"| {row['run']} | {row.get('workload', '')} | {row['wall_s']} | {row.get('rc', '')} | {stages} "
                f"| {row.get('peak_reserved_gib', '')} | {row.get('nvml_peak_gib', '')} | {row.get('md5', '') or ''} "
                f"| {' '.join(f'{k}:{v}' for k, v in row.get('stage_sums', {}).items())} "
                f"| {row.get('compile_notices', '')} | {row.get('note', '')} {row.get('error') or ''} |"
            )
        lines += ["", "| target | measured | verdict |", "|---|---|---|"]
        lines += [f"| {v['target']} | {_measured(v)} | {_verdict(v)} |" for v in self.verdicts()]
        return "\n".join(lines) + "\n"


def _text(output: str | bytes | None) -> str:
    """A timed-out command's captured output: bytes on some platforms even with `text=True`."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def run_memory(check: Check) -> None:
    """bench/memory_bench.py's modes on this call's bundle, one process each; a row per mode, and its verdicts."""
    # memory_bench keeps its bundle under another name in the same work folder: the same files, not written twice.
    alias = check.work / ("bundle-tiny" if check.args.tiny else "bundle-full")
    if not alias.exists():
        alias.symlink_to(check.work / "bundle")
    out = check.out / "memory"
    argv = [sys.executable, str(ROOT / "bench" / "memory_bench.py"), "--modes", MEMORY_MODES]
    argv += ["--work", str(check.work), "--out", str(out), "--deadline", str(int(max(60, check.left() - 20)))]
    result = check.command("memory", argv + ["--tiny"] * check.args.tiny)
    report = out / "memory-bench.json"
    modes = json.loads(report.read_text()) if report.exists() else {"modes": {}, "targets": {}}
    for mode, entry in modes["modes"].items():
        note = (entry.get("budget") or {}).get("summary") or entry.get("error") or entry.get("skipped", "")
        row = {"run": f"memory-{mode}", "group": "memory", "rc": 0 if "seconds" in entry else 1, "note": note}
        row.update(wall_s=entry.get("seconds"), peak_reserved_gib=entry.get("peak_reserved_gib"))
        check.add_row(row)
    check.memory_targets = modes.get("targets", {})
    if result["rc"] != 0:
        check.add_row({"run": "memory", "group": "memory", "rc": result["rc"], "wall_s": result["wall_s"]})


def memory_verdicts(targets: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """memory_bench's checks as verdicts: each mode runs, its peak stays under its cap, and its time ratio where one
    is set."""
    found = [
        {"target": f"{row['run']} completes", "measured": row["note"] or row["rc"], "pass": row["rc"] == 0}
        for row in rows
        if row.get("group") == "memory"
    ]
    for mode, check in targets.items():
        found.append(
            {
                "target": f"memory {mode}: peak reserved <= {check['cap_gib']} GiB",
                "measured": check["reserved_gib"],
                "pass": check["reserved_ok"],
            }
        )
        if "time_ok" in check:
            ratio = check.get("vs_whole_decode", check.get("vs_default"))
            against = "the whole-tile decode" if "vs_whole_decode" in check else "the default"
            found.append({"target": f"memory {mode}: time vs {against}", "measured": ratio, "pass": check["time_ok"]})
    return found


def _measured(verdict: dict[str, Any]) -> str:
    if verdict["measured"] is None and verdict.get("missing"):
        return "no " + ", ".join(verdict["missing"])
    return str(verdict["measured"])


def _verdict(verdict: dict[str, Any]) -> str:
    if verdict["pass"] is None:
        return "not measured" if verdict["measured"] is None else "measured"
    return "pass" if verdict["pass"] else "FAIL"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--runner-child"]:
        return same_bytes.main_child(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/k6vsr-check", help="bundle, clips, stores (kept between calls)")
    parser.add_argument("--out", default=os.environ.get("OUT", "device-check-out"))
    parser.add_argument("--deadline", type=float, default=540, help="seconds this call may take")
    parser.add_argument(
        "--runs",
        default="oneshot,W2,workers",
        help="comma-separated: oneshot (W1, cold or imported cache), reimport (export, wipe, import, W1 again), "
        "inmemory (the in-memory runner on W1, first and hot), W2, warm (W1 one-shot with the warm cache), "
        "workers (start, W1 twice, stop), multiwindow (a three-window clip one-shot), preview (`k6vsr preview "
        "--windows 1` of that clip, then the whole run on its store: the estimate against the run), archive (W1 "
        "clips through `k6vsr archive`), same-bytes (bench/same_bytes.py), memory (bench/memory_bench.py's modes "
        f"{MEMORY_MODES}, through the in-memory runner), two-gpus (bench/two_gpus.py: warm workers on one GPU, then "
        "on every GPU); run in that order",
    )
    parser.add_argument(
        "--two-gpu-parts",
        default=",".join(two_gpus.PARTS),
        help="comma-separated, the two-gpus runs on each set of workers: w1 (W1 twice), multiwindow (three windows), "
        "archive (--archive-clips W1 clips), kill (all GPUs: W1 with a worker SIGKILLed mid-tile)",
    )
    parser.add_argument("--archive-clips", type=int, default=4, help="W1 clips in the archive run")
    parser.add_argument("--archive-max-parallel", type=int, default=None, help="the archive's --max-parallel")
    parser.add_argument("--same-workload", default="W2", choices=sorted(WORKLOADS), help="the same-bytes runs' clip")
    parser.add_argument("--parallel", type=int, default=3, help="same-bytes runs at once (their md5s do not care)")
    parser.add_argument("--cache-import", default=None, help="a `k6vsr cache export` file to import first")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny bundle, small clips")
    parser.add_argument(
        "--reuse-rows",
        default=None,
        help="an earlier call's device-check.json on this machine: its in-memory rows are this call's reference "
        "(instead of running `inmemory` again), marked as from that call",
    )
    args = parser.parse_args(argv)
    if args.archive_clips < 1:
        parser.error(f"--archive-clips must be at least 1, not {args.archive_clips}")
    try:
        parts = two_gpus.parse_parts(args.two_gpu_parts)
    except ValueError as err:
        parser.error(str(err))
    check = Check(args)
    check.out.mkdir(parents=True, exist_ok=True)
    check.work.mkdir(parents=True, exist_ok=True)
    runs = args.runs.split(",")
    check.log(f"README GPU command: {shlex.join(readme_gpu_command())}")
    if args.reuse_rows:
        check.reuse(Path(args.reuse_rows))
    check.bundle()
    check.clip("W1"), check.clip("W2")
    if args.cache_import:
        check.cli("cache-import", "cache", "import", str(Path(args.cache_import).absolute()))
    if "oneshot" in runs:
        note = "imported cache" if args.cache_import else "cold compile cache"
        check.upscale("oneshot-W1", "W1", note)
    if "reimport" in runs and check.fits("oneshot"):
        exported = check.out / "compile-cache.zip"
        check.cli("cache-export", "cache", "export", str(exported))
        from k6vsr_core.device.compile_cache import compile_cache_dir

        shutil.rmtree(compile_cache_dir(), ignore_errors=True)
        for stray in Path("/tmp").glob("torchinductor_*"):
            shutil.rmtree(stray, ignore_errors=True)
        check.cli("cache-import", "cache", "import", str(exported))
        check.upscale("oneshot-W1-imported", "W1", "compile cache wiped, then the exported file imported")
    if "inmemory" in runs and check.fits("inmemory"):
        streaming.run_inmemory(check)  # first of the timed runs, alone on the device, so that it compiles what they use
    if "W2" in runs and check.fits("W2"):
        check.upscale("oneshot-W2", "W2", "")
    if "warm" in runs and check.fits("oneshot"):
        check.upscale("oneshot-W1-warm", "W1", "imported cache" if args.cache_import else "warm compile cache")
    if "workers" in runs and check.fits("workers-start"):
        check.cli("workers-start", "workers", "start", "--model", str(check.work / "bundle"))
        for n in (1, 2):
            if check.fits("workers-run"):
                check.upscale(f"workers-W1-{n}", "W1", "warm workers")
        check.cli("workers-stop", "workers", "stop")
    if "multiwindow" in runs and check.fits("multiwindow"):
        streaming.run_multiwindow(check)
    if "preview" in runs and check.fits("preview"):
        preview_check.run_preview(check)
    if "archive" in runs and check.fits("archive-clip", args.archive_clips):
        streaming.run_archive(check, args.archive_clips, args.archive_max_parallel)
    if "same-bytes" in runs:
        same_bytes.run_same_bytes(check, args.same_workload, args.parallel)
    if "memory" in runs:
        run_memory(check)
    if "two-gpus" in runs:
        two_gpus.run_two_gpus(check, parts, args.archive_clips, args.archive_max_parallel)
    # The local Prefect server the runs started lasts by design; the check's own home is not the user's: stop it.
    check.command("server-stop", [sys.executable, "-m", "entrypoints.cli", "server", "stop"])
    skipped = [
        r
        for r in runs
        if not any(row["run"].startswith(r) or r in row["run"] or row.get("group") == r for row in check.rows)
    ]
    if skipped:
        check.log(f"not run (deadline or not asked): {skipped}")
    check.save()
    print(check.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
