"""The device check's runs for the two-GPU issue (#24): W1, a multi-window clip and an archive on warm workers, on one
GPU and then on every visible GPU, and a worker killed mid-tile; every ratio from runs of the same call.

    python bench/device_check.py --runs two-gpus [--two-gpu-parts w1,multiwindow,archive,kill] [--archive-clips N]

Two sets of warm workers, one after the other, each started with the check's bundle (`k6vsr workers start --gpus
--model ...`), checked with `k6vsr workers status --json` (one worker per GPU of the set, or the set is not run) and
stopped (`k6vsr workers stop`) after its runs; every command of a set runs with the set's environment:

- `one-gpu`: `CUDA_VISIBLE_DEVICES` set to the first visible GPU, so the workers, and every command, see one;
- `all-gpus`: the check's environment as it is, one worker per visible GPU (at least 2, else one row says so and
  nothing runs).

In each set, as `--two-gpu-parts` asks (in this order), the README's GPU command on the warm workers, each run with a
store and an output folder of its own:

- `w1`: W1 twice; the second run is the figure (the first loads what the shapes need);
- `multiwindow`: streaming's three-window clip (`W1-long`), seconds per window measured as streaming measures them
  (the GPU stream: the first GPU item's start to the last one's end, over the windows; `bench/streaming.py`);
- `archive`: streaming's archive of `--archive-clips` W1 clips through `k6vsr archive` (clips per hour), with
  `--max-parallel` from `--archive-max-parallel` on both sets (the command's default runs one clip at a time: a
  second GPU then helps only with the tiles of that clip, not with its ingest, blend, segment and mux);
- `kill` (all GPUs only): W1 once more while a watcher polls the run's timeline: at the first denoise item written,
  the worker that did not write it (still in its own tile) is SIGKILLed (`kill -s KILL PID`, the pid from the
  status taken just before). The nanny restarts it, the other worker takes the tile; the run must finish with the
  one-GPU W1's md5 (`kill` without `w1` runs W1 once on one GPU for that md5).

`--tiny` runs the same plumbing on the CPU: the "GPUs" are CPU workers (`workers start -n 1`, then `-n 2`) with
`CUDA_VISIBLE_DEVICES` empty for every command, on the check's tiny workloads.

`verdicts` checks the issue's targets (`TARGETS` in device_check.py): W1's second run on all GPUs at most 0.55x one
GPU's and its md5 equal to one GPU's; the multi-window seconds per window at most 0.55x; the archive's clips per hour
at least 1.9x; the killed run completes with one GPU's md5. A target whose runs did not happen or failed reads "not
measured".

What fits in one 10-minute call (`--deadline 560`, a machine that already has the bundle and a warm compile cache:
first `--runs oneshot` or `--cache-import FILE`), at the costs in `COST`; each call measures its own one-GPU
references, so every ratio is of one call:

    python3 bench/device_check.py --runs two-gpus --two-gpu-parts w1,kill --deadline 560
    python3 bench/device_check.py --runs two-gpus --two-gpu-parts multiwindow --deadline 560
    python3 bench/device_check.py --runs two-gpus --two-gpu-parts archive --archive-clips 4 --archive-max-parallel 2 \\
        --deadline 560

An archive of 8 clips (the issue's) costs about 15 minutes over both sets at those speeds, more than one call; the
parts that would pass the deadline are left out before anything starts, and listed in a row.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import streaming

if TYPE_CHECKING:
    from bench.check_kit import Check

GROUP = "two-gpus"
PARTS = ("w1", "multiwindow", "archive", "kill")
ONE, ALL = "one-gpu", "all-gpus"
W1_FIGURE = "W1-2"  # the second W1 run of a set: the one the ratio uses
KILLED = f"{ALL}-W1-killed"
POLL_S = 0.2  # how often the watcher reads the killed run's timeline


@dataclass(frozen=True)
class GpuSet:
    """One set of warm workers: its name (the prefix of its rows), the workers it starts and the environment every
    command of the set runs with."""

    name: str
    workers: int
    start_args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


def visible_gpus() -> list[str]:
    """The GPUs the workers would use, as CUDA_VISIBLE_DEVICES names them."""
    from runtime.warm_workers import gpu_ids

    return gpu_ids()


def gpu_sets(gpus: list[str], tiny: bool) -> tuple[GpuSet, GpuSet]:
    """The one-GPU set and the all-GPU set; with `tiny`, one and two CPU workers with no GPU visible."""
    if tiny:
        cpu = {"CUDA_VISIBLE_DEVICES": ""}
        return GpuSet(ONE, 1, ("-n", "1"), cpu), GpuSet(ALL, 2, ("-n", "2"), cpu)
    return (
        GpuSet(ONE, 1, ("--gpus",), {"CUDA_VISIBLE_DEVICES": gpus[0]}),
        GpuSet(ALL, len(gpus), ("--gpus",)),
    )


def parse_parts(text: str) -> list[str]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [part for part in parts if part not in PARTS]
    if unknown or not parts:
        raise ValueError(f"--two-gpu-parts: {', '.join(unknown) or 'nothing'} is not one of {', '.join(PARTS)}")
    return [part for part in PARTS if part in parts]


def part_cost(part: str, clips: int, parts: list[str]) -> float:
    """Rough seconds a part takes over both sets (device_check.COST)."""
    from bench.check_kit import COST

    if part == "w1":
        return 2 * (COST["gpu1-W1"] + COST["gpus-W1"])
    if part == "multiwindow":
        return COST["gpu1-multiwindow"] + COST["gpus-multiwindow"]
    if part == "archive":
        return clips * (COST["gpu1-archive-clip"] + COST["gpus-archive-clip"])
    return COST["gpus-kill"] + (0 if "w1" in parts else COST["gpu1-W1"])  # kill: its one-GPU md5 from a W1 of its own


def fitting(parts: list[str], clips: int, seconds: float) -> tuple[list[str], list[str]]:
    """The parts that fit in `seconds` with both sets' starts and stops, the later ones left out first."""
    from bench.check_kit import COST

    kept = list(parts)
    overhead = 2 * (COST["gpus-start"] + COST["gpus-stop"]) + COST["gpus-stop"]
    while kept and overhead + sum(part_cost(part, clips, kept) for part in kept) > seconds:
        kept.pop()
    return kept, [part for part in parts if part not in kept]


def run_two_gpus(check: Check, parts: list[str], clips: int, max_parallel: int | None = None) -> None:
    """Both sets of warm workers and their runs, as `parts` asks (the archive's `--max-parallel` the same for both);
    rows and verdicts go into `check`."""
    gpus = [] if check.args.tiny else visible_gpus()
    if not check.args.tiny and len(gpus) < 2:
        note = f"{len(gpus)} GPU visible ({', '.join(gpus) or 'none'}): the two-GPU runs need at least 2; none run"
        check.add_row({"run": GROUP, "group": GROUP, "wall_s": 0.0, "note": note})
        return
    kept, left_out = fitting(parts, clips, check.left())
    if left_out:
        note = f"left out, they would pass the deadline: {', '.join(left_out)}"
        check.add_row({"run": f"{GROUP}-left-out", "group": GROUP, "wall_s": 0.0, "note": note})
    if not kept:
        return
    one, every = gpu_sets(gpus, check.args.tiny)
    _cli(check, f"{GROUP}-workers-clear", one.env, "workers", "stop")  # workers an earlier call left would be reused
    run_set(check, one, kept, clips, max_parallel)
    run_set(check, every, kept, clips, max_parallel)


def run_set(check: Check, gpu_set: GpuSet, parts: list[str], clips: int, max_parallel: int | None = None) -> None:
    """Start the set's warm workers, run its parts on them, stop them."""
    name, env = gpu_set.name, gpu_set.env
    bundle = str(check.work / "bundle")
    _cli(check, f"{name}-workers-start", env, "workers", "start", *gpu_set.start_args, "--model", bundle)
    workers = status_workers(check, f"{name}-workers-status", env)
    if len(workers) != gpu_set.workers:
        found = ", ".join(f"pid {w.get('pid')} GPU {w.get('gpu')}" for w in workers) or "none"
        note = f"expected {gpu_set.workers} warm workers, found {len(workers)} ({found}): the set's runs are not run"
        check.add_row({"run": f"{name}-workers", "group": GROUP, "wall_s": 0.0, "rc": 1, "note": note})
    else:
        cost = "gpu1" if name == ONE else "gpus"
        w1_runs = 2 if "w1" in parts else 1 if "kill" in parts and name == ONE else 0
        for index in range(1, w1_runs + 1):
            if check.fits(f"{cost}-W1"):
                check.add_row(run(check, f"{name}-W1-{index}", "W1", env, f"warm workers, {_gpus(gpu_set)}"))
        if "multiwindow" in parts and check.fits(f"{cost}-multiwindow"):
            run_multiwindow(check, gpu_set)
        if "archive" in parts and check.fits(f"{cost}-archive-clip", clips):
            run_archive(check, gpu_set, clips, max_parallel)
        if "kill" in parts and name == ALL and check.fits("gpus-kill"):
            run_killed(check, gpu_set)
    _cli(check, f"{name}-workers-stop", env, "workers", "stop")


def _gpus(gpu_set: GpuSet) -> str:
    what = "CPU worker" if gpu_set.env.get("CUDA_VISIBLE_DEVICES") == "" else "GPU"
    return f"{gpu_set.workers} {what}{'s' if gpu_set.workers > 1 else ''}"


def _cli(check: Check, label: str, env: dict[str, str], *args: str) -> dict[str, Any]:
    """A `k6vsr` command in the set's environment, and its row."""
    result = check.command(label, [sys.executable, "-m", "entrypoints.cli", *args], {**check.env, **env})
    row = {"run": label, "group": GROUP, "wall_s": result["wall_s"], "rc": result["rc"], "note": " ".join(args)}
    if args[:2] == ("workers", "status"):
        row["workers"] = [{"pid": w.get("pid"), "gpu": w.get("gpu")} for w in listed_workers(result["stdout"])]
    check.add_row(row)
    return result


def listed_workers(stdout: str) -> list[dict[str, Any]]:
    """The warm workers `k6vsr workers status --json` printed (pid, GPU, models); none when it printed no status."""
    try:
        status = json.loads(stdout[stdout.index("{") :]) if "{" in stdout else {}
    except ValueError:
        status = {}
    return status.get("workers", []) if status.get("running") else []


def status_workers(check: Check, label: str, env: dict[str, str]) -> list[dict[str, Any]]:
    """The warm workers running now, as `k6vsr workers status --json` lists them; the status is a row."""
    return listed_workers(_cli(check, label, env, "workers", "status", "--json")["stdout"])


def run(check: Check, label: str, workload: str, env: dict[str, str], note: str) -> dict[str, Any]:
    """The README's GPU command on `workload`, on the running warm workers, with a fresh store and output folder; its
    row, not yet added."""
    from bench.check_kit import as_run, readme_gpu_command

    store, out_dir = _fresh(check, label)
    argv = as_run(readme_gpu_command(), check.clip(workload), out_dir)
    return check.measure(label, workload, note, argv, env, store, out_dir, GROUP, add=False)


def _fresh(check: Check, label: str) -> tuple[Path, Path]:
    store, out_dir = check.work / f"store-{label}", check.work / f"out-{label}"
    for folder in (store, out_dir):  # nothing reused: every tile computed in this run
        shutil.rmtree(folder, ignore_errors=True)
    return store, out_dir


def run_multiwindow(check: Check, gpu_set: GpuSet) -> dict[str, Any]:
    """Streaming's three-window clip on the set's workers; its row with seconds per window."""
    label = f"{gpu_set.name}-multiwindow"
    row = run(check, label, "W1-long", gpu_set.env, f"three windows, warm workers, {_gpus(gpu_set)}")
    store = check.work / f"store-{label}"
    row.update(streaming.per_window(row["wall_s"], streaming.flow_span(row["stages"]), streaming.gpu_stream(store)))
    if row["windows"]:
        wall, gpu = row["s_per_window_wall"], row["s_per_window_gpu"]
        row["note"] += f"; {row['windows']} windows, s/window: wall {wall}, GPU stream {gpu}"
    check.add_row(row)
    return row


def run_archive(check: Check, gpu_set: GpuSet, clips: int, max_parallel: int | None = None) -> dict[str, Any]:
    """Streaming's archive of `clips` W1 clips through `k6vsr archive` on the set's workers; its row."""
    from bench.check_kit import as_archive, readme_gpu_command

    label = f"{gpu_set.name}-archive"
    folder = streaming.archive_input(check, clips)
    store, out_dir = _fresh(check, label)
    argv = as_archive(readme_gpu_command(), folder, out_dir)
    if max_parallel is not None:
        argv += ["--max-parallel", str(max_parallel)]
    note = f"{clips} W1 clips, warm workers, {_gpus(gpu_set)}" + (
        f", --max-parallel {max_parallel}" if max_parallel else ""
    )
    row = check.measure(label, f"W1 x{clips}", note, argv, gpu_set.env, store, out_dir, GROUP, add=False)
    row["md5"] = None  # one output per clip, each with its own tone: no md5 to compare
    row.update(streaming.archive_figures(out_dir, row["wall_s"], clips))
    row["note"] += f"; {row['clips_done']}/{clips} done, {row['clips_per_hour']} clips/h"
    check.add_row(row)
    return row


def first_denoise_pid(store: Path) -> int | None:
    """The process that wrote the run's first denoise item, once its timeline shows one."""
    from bench.check_kit import timeline_lines

    try:
        lines = [line for line in timeline_lines(store) if line["stage"] == "denoise"]
    except ValueError:  # a line being appended: read again at the next poll
        return None
    return min(lines, key=lambda line: line["end"])["pid"] if lines else None


def victim(workers: list[dict[str, Any]], writer: int) -> dict[str, Any]:
    """The worker to kill: one that did not write the first denoise item (busy with its own tile), else the writer."""
    others = [worker for worker in workers if worker.get("pid") != writer]
    return (others or workers)[0]


def run_killed(check: Check, gpu_set: GpuSet) -> dict[str, Any]:
    """W1 on the set's workers with one of them SIGKILLed mid-tile; its row with who was killed when."""
    workers = status_workers(check, f"{gpu_set.name}-status-before-kill", gpu_set.env)
    store = check.work / f"store-{KILLED}"
    shutil.rmtree(store, ignore_errors=True)  # the watcher must not see an earlier call's timeline
    ended = threading.Event()
    kill: dict[str, Any] = {}
    watcher = threading.Thread(target=_watch, args=(check, gpu_set, store, workers, ended, kill), daemon=True)
    started = time.time()
    watcher.start()
    try:
        row = run(check, KILLED, "W1", gpu_set.env, f"warm workers, {_gpus(gpu_set)}, one SIGKILLed mid-tile")
    finally:
        ended.set()
        watcher.join()
    row["kill"] = {**kill, "after_s": round(kill["at"] - started, 1) if "at" in kill else None}
    row["kill"].pop("at", None)
    if kill.get("rc") == 0:
        gpu = f" (GPU {kill['gpu']})" if kill.get("gpu") else ""
        row["note"] += (
            f"; killed pid {kill['pid']}{gpu} {row['kill']['after_s']} s in, after pid {kill['writer']} wrote the "
            "first denoise item"
        )
    else:
        row["note"] += f"; no worker killed: {kill.get('error', 'the run ended before a denoise item was written')}"
    check.add_row(row)
    # The workers after it: the nanny's fresh process in the killed one's place.
    row["workers_after"] = [
        worker.get("pid") for worker in status_workers(check, f"{gpu_set.name}-status-after-kill", gpu_set.env)
    ]
    row["note"] += f"; workers after: {row['workers_after']}"
    check.save()
    return row


def _watch(
    check: Check,
    gpu_set: GpuSet,
    store: Path,
    workers: list[dict[str, Any]],
    ended: threading.Event,
    kill: dict[str, Any],
) -> None:
    """Until the run ends: at its first denoise item, SIGKILL a worker; what was done goes into `kill`."""
    while not ended.wait(POLL_S):
        writer = first_denoise_pid(store)
        if writer is None:
            continue
        if not workers:
            kill["error"] = "workers status listed no worker to kill"
            return
        target = victim(workers, writer)
        kill.update(pid=target["pid"], gpu=target.get("gpu"), writer=writer, at=time.time())
        result = check.command(f"{gpu_set.name}-kill", ["kill", "-s", "KILL", str(target["pid"])], check.env)
        kill["rc"] = result["rc"]
        if result["rc"] != 0:
            kill["error"] = f"kill exited {result['rc']}: {result['stderr'].strip()}"
        return


def verdicts(rows: list[dict[str, Any]], targets: dict[str, float]) -> list[dict[str, Any]]:
    """The two-GPU issue's targets from the runs of this call; "not measured" (pass and measured None, with the runs
    that did not happen or failed under `missing`) where a run they need is not there to measure."""
    judged = streaming.Verdicts(rows)
    runs, verdict, found = judged.runs, judged.add, judged.found

    one_w1, all_w1 = f"{ONE}-{W1_FIGURE}", f"{ALL}-{W1_FIGURE}"
    speed = targets["two_gpus_w1_vs_one"]

    def w1() -> tuple[str, bool]:
        ratio = round(runs[all_w1]["wall_s"] / runs[one_w1]["wall_s"], 3)
        return f"{runs[all_w1]['wall_s']} s / {runs[one_w1]['wall_s']} s = {ratio}x", ratio <= speed

    verdict(f"W1 on all GPUs, second run <= {speed}x one GPU's", [one_w1, all_w1], w1)

    def same(name: str) -> tuple[str, bool]:
        reference, digest = runs[one_w1]["md5"], runs[name]["md5"]
        return f"{digest} vs one GPU's {reference}", digest is not None and digest == reference

    verdict("W1 on all GPUs: the md5 of one GPU's", [one_w1, all_w1], lambda: same(all_w1))

    window_goal = targets["two_gpus_window_vs_one"]
    one_mw, all_mw = f"{ONE}-multiwindow", f"{ALL}-multiwindow"

    def multiwindow() -> tuple[str, bool]:
        one, every_gpu = runs[one_mw], runs[all_mw]
        if min(one["windows"], every_gpu["windows"]) < 3:
            return f"{every_gpu['windows']} and {one['windows']} windows in the timelines, not 3", False
        ratio = round(every_gpu["s_per_window_gpu"] / one["s_per_window_gpu"], 3)
        measured = (
            f"GPU stream {every_gpu['s_per_window_gpu']} s a window / {one['s_per_window_gpu']} s = {ratio}x "
            f"(wall {every_gpu['s_per_window_wall']} / {one['s_per_window_wall']} s)"
        )
        return measured, ratio <= window_goal

    verdict(f"multi-window on all GPUs: s/window <= {window_goal}x one GPU's", [one_mw, all_mw], multiwindow)

    archive_goal = targets["two_gpus_archive_vs_one"]
    one_ar, all_ar = f"{ONE}-archive", f"{ALL}-archive"

    def archive() -> tuple[str, bool]:
        one, every_gpu = runs[one_ar], runs[all_ar]
        done = every_gpu["clips_done"] == every_gpu["clips"] and one["clips_done"] == one["clips"]
        if not one["clips_per_hour"]:
            return f"one GPU: {one['clips_done']}/{one['clips']} clips done", False
        ratio = round(every_gpu["clips_per_hour"] / one["clips_per_hour"], 3)
        measured = (
            f"{every_gpu['clips_per_hour']} clips/h ({every_gpu['clips_done']}/{every_gpu['clips']} in "
            f"{every_gpu['wall_s']} s) / {one['clips_per_hour']} ({one['clips_done']}/{one['clips']} in "
            f"{one['wall_s']} s) = {ratio}x"
        )
        return measured, ratio >= archive_goal and done

    verdict(f"archive on all GPUs: clips/h >= {archive_goal}x one GPU's", [one_ar, all_ar], archive)

    reference = one_w1 if one_w1 in runs else f"{ONE}-W1-1"

    def killed() -> tuple[str, bool]:
        row, kill = runs[KILLED], runs[KILLED].get("kill", {})
        if kill.get("rc") != 0:
            return f"no worker killed: {kill.get('error', 'no denoise item seen before the run ended')}", False
        digest, expected = row["md5"], runs[reference]["md5"]
        measured = f"pid {kill['pid']} killed {kill['after_s']} s in; {digest} vs one GPU's {expected}"
        return measured, digest is not None and digest == expected

    verdict("a worker SIGKILLed mid-tile: the run completes with one GPU's md5", [KILLED, reference], killed)
    return found
