"""The device check's runs for the streaming issue (#23): the in-memory runner, a clip of three windows, an archive.

    python bench/device_check.py --runs inmemory,warm,workers
    python bench/device_check.py --runs inmemory,multiwindow,archive [--archive-clips 4] [--archive-max-parallel N]

- `inmemory`: the in-memory runner (`k6vsr_core.upscale`) on W1 in a process of its own, on a bundle loaded and
  compiled as the command does (`device_check.py --runner-child`, as the same-bytes set runs it), a first run
  (compiles, or loads the compile cache) and a hot one; each row has the runner's per-stage busy seconds
  (`timings`) and the GPU work: encode + denoise + decode.
- `multiwindow`: W1's size for 331 frames (121 + 2 x 105: three windows) through the README's GPU command, one-shot;
  the row has seconds per window three ways: the wall time's, the flow's (its timeline's first item's start to the
  last's end) and the GPU stream's (the first GPU item's start to the last's end: what the GPU takes for the
  windows when it never waits; robust to windows computed side by side, and free of the first window's ingest and
  the last one's blend, segment and mux, which a longer clip spreads over more windows).
- `archive`: `--archive-clips` W1 clips (each with a tone of its own, so that each is a run of its own) in an input
  folder through `k6vsr archive IN -o OUT` with the README's GPU command's flags, one-shot; the row has the wall time,
  clips per hour and each clip's seconds from the archive's manifest.

Every one-shot here runs with `K6VSR_WARM_WORKERS=off`: it computes in its own processes whatever else runs.

`verdicts` checks the issue's targets, each a ratio of runs of the same call: the warm workers' first and second W1
run against the in-memory runner hot, the runner hot against its GPU work, the warm one-shot against the runner hot,
the multi-window GPU stream's seconds per window against one window's GPU work (the runner's hot W1), and the archive's
clips per hour against the runner hot run serially. A target whose runs did not happen, or failed, is "not measured".
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import same_bytes
from k6vsr_core.contract.stage_names import MODEL_STAGES

if TYPE_CHECKING:
    from bench.check_kit import Check

INMEMORY = "inmemory-W1"
INMEMORY_HOT = f"{INMEMORY}-2"
MULTIWINDOW = "multiwindow-W1"
ARCHIVE = "archive-W1"
WARM_ONESHOT = "oneshot-W1-warm"
WORKER_RUNS = ("workers-W1-1", "workers-W1-2")
# The runner's stages that keep the GPU busy; blend and segment run on a thread beside them, ingest and mux around.
GPU_STAGES = MODEL_STAGES
ONE_SHOT = {"K6VSR_WARM_WORKERS": "off"}
ARCHIVE_TONE_HZ = 440.0  # clip i's tone is ARCHIVE_TONE_HZ + 20 i: other bytes, another run key, the same frames


def gpu_work(timings: dict[str, float]) -> float:
    """Seconds the runner's GPU stages were busy."""
    return round(sum(timings.get(stage, 0.0) for stage in GPU_STAGES), 2)


def run_inmemory(check: Check) -> None:
    """The in-memory runner on W1 twice in one child process; one row per run."""
    result, report = same_bytes.runner_report(check, INMEMORY, "W1")
    for index, repeat in enumerate(report.get("repeats", [])):
        timings = repeat.get("timings", {})
        work = gpu_work(timings)
        split = ", ".join(f"{stage} {seconds}" for stage, seconds in timings.items())
        check.add_row(
            {
                "run": f"{INMEMORY}-{index + 1}",
                "workload": "W1",
                "note": f"{'first (compiles, or loads the compile cache)' if index == 0 else 'hot'}; "
                f"GPU work {work} s ({split})",
                "wall_s": repeat["seconds"],
                "rc": result["rc"],
                "peak_reserved_gib": repeat.get("peak_reserved_gib"),
                "md5": repeat["md5"],
                "timings": timings,
                "gpu_work_s": work,
                "process_wall_s": result["wall_s"],
            }
        )
    if not report:
        check.add_row(
            {
                "run": INMEMORY,
                "workload": "W1",
                "wall_s": result["wall_s"],
                "rc": result["rc"] or 1,  # exited 0 without its report: a failure all the same
                "md5": None,
                "error": result["stderr"].strip().splitlines()[-1:],
            }
        )


def run_multiwindow(check: Check) -> dict[str, Any]:
    """The README's GPU command, one-shot, on the three-window clip; its row with seconds per window."""
    from bench.check_kit import as_run, readme_gpu_command

    store, out_dir = check.work / f"store-{MULTIWINDOW}", check.work / f"out-{MULTIWINDOW}"
    for fresh in (store, out_dir):
        shutil.rmtree(fresh, ignore_errors=True)
    argv = as_run(readme_gpu_command(), check.clip("W1-long"), out_dir)
    row = check.measure(MULTIWINDOW, "W1-long", "three windows, one-shot", argv, ONE_SHOT, store, out_dir, add=False)
    row.update(per_window(row["wall_s"], flow_span(row["stages"]), gpu_stream(store)))
    if row["windows"]:
        row["note"] += (
            f"; {row['windows']} windows, s/window: wall {row['s_per_window_wall']}, flow {row['s_per_window_flow']}, "
            f"GPU stream {row['s_per_window_gpu']}"
        )
    check.add_row(row)
    return row


def gpu_stream(store: Path) -> tuple[int, float | None]:
    """From the run's timeline: the windows its GPU items (encode, denoise, decode; named `<window>` or
    `<window>-<tile>`) belong to, and the seconds from the first one's start to the last one's end."""
    from bench.check_kit import timeline_lines

    windows: set[str] = set()
    first, last = float("inf"), float("-inf")
    for line in timeline_lines(store):
        if line["stage"] in GPU_STAGES:
            windows.add(str(line["item"]).split("-")[0])
            first, last = min(first, line["start"]), max(last, line["end"])
    return len(windows), (last - first if windows else None)


def flow_span(stages: dict[str, list[float]]) -> float | None:
    """Seconds from the first item's start to the last item's end, over every stage of the timeline."""
    if not stages:
        return None
    return max(span[1] for span in stages.values()) - min(span[0] for span in stages.values())


def per_window(wall: float, flow: float | None, gpu: tuple[int, float | None]) -> dict[str, Any]:
    """Seconds per window of the wall time, the flow's span and the GPU stream's span (`gpu`: windows, span)."""
    count, span = gpu
    if count == 0 or span is None:
        return {"windows": 0}
    return {
        "windows": count,
        "s_per_window_wall": round(wall / count, 1),
        "s_per_window_flow": None if flow is None else round(flow / count, 1),
        "s_per_window_gpu": round(span / count, 1),
    }


def archive_input(check: Check, clips: int) -> Path:
    """A fresh input folder holding `clips` W1 clips, each with a tone of its own (made once per machine)."""
    from k6vsr_core.media.sample import make_sample_clip

    width, height, frames = check.workloads["W1"]
    made = check.work / "archive-clips"
    made.mkdir(exist_ok=True)
    folder = check.work / "archive-in"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for index in range(clips):
        clip = made / f"W1-{index}.mp4"
        if not clip.exists():
            part = clip.with_suffix(".part.mp4")
            tone = ARCHIVE_TONE_HZ + 20 * index
            make_sample_clip(part, width=width, height=height, num_frames=frames, fps=24, tone_hz=tone)
            part.rename(clip)
        shutil.copyfile(clip, folder / clip.name)
    return folder


def run_archive(check: Check, clips: int, max_parallel: int | None) -> dict[str, Any]:
    """`clips` W1 clips through `k6vsr archive` with the README's GPU command's flags, one-shot; its row."""
    from bench.check_kit import as_archive, readme_gpu_command

    folder = archive_input(check, clips)
    store, out_dir = check.work / f"store-{ARCHIVE}", check.work / f"out-{ARCHIVE}"
    for fresh in (store, out_dir):  # nothing reused: every clip computed in this run
        shutil.rmtree(fresh, ignore_errors=True)
    argv = as_archive(readme_gpu_command(), folder, out_dir)
    if max_parallel is not None:
        argv += ["--max-parallel", str(max_parallel)]
    note = f"{clips} W1 clips, one-shot" + (f", --max-parallel {max_parallel}" if max_parallel else "")
    row = check.measure(ARCHIVE, f"W1 x{clips}", note, argv, ONE_SHOT, store, out_dir, add=False)
    row["md5"] = None  # one output per clip, each with its own tone: no md5 to compare
    row.update(archive_figures(out_dir, row["wall_s"], clips))
    row["note"] += f"; {row['clips_done']}/{clips} done, {row['clips_per_hour']} clips/h"
    hot = next((r for r in check.rows if r["run"] == INMEMORY_HOT and r.get("rc") == 0), None)
    if hot is not None:  # the serial comparison: the same clips through the in-memory runner one after another
        row["serial_inmemory_s"] = round(clips * hot["wall_s"], 1)
        row["note"] += f"; serial in-memory {clips} x {hot['wall_s']} s = {row['serial_inmemory_s']} s"
    check.add_row(row)
    return row


def archive_figures(out_dir: Path, wall: float, clips: int) -> dict[str, Any]:
    """From the archive's manifest: the clips done (computed in this run: a fresh output folder has none to reuse),
    their seconds, and clips per hour over the command's wall time."""
    from flows.archive.report import MANIFEST_NAME

    manifest = out_dir / f"{MANIFEST_NAME}.json"
    rows = json.loads(manifest.read_text())["rows"] if manifest.is_file() else []
    done = [row for row in rows if row.get("status") == "done"]
    return {
        "clips": clips,
        "clips_done": len(done),
        "clip_seconds": [row.get("seconds") for row in done],
        "clips_per_hour": round(len(done) * 3600 / wall, 1) if wall > 0 else None,
    }


class Verdicts:
    """Targets judged from the rows of one call: a target whose runs did not happen, or failed, is "not measured"
    (pass and measured None, with those runs under `missing`)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.every = {row["run"]: row for row in rows}
        self.runs = {name: row for name, row in self.every.items() if row.get("rc") == 0}
        self.found: list[dict[str, Any]] = []

    def add(self, target: str, needs: list[str], measure: Callable[[], tuple[Any, bool | None]]) -> None:
        """Judge `target` by `measure()` (what was measured, and whether it passes) if every run it `needs` is in."""
        missing = [
            name if name not in self.every else f"{name} (exit {self.every[name].get('rc')})"
            for name in needs
            if name not in self.runs
        ]
        if missing:
            self.found.append({"target": target, "measured": None, "pass": None, "missing": missing})
            return
        measured, passed = measure()
        self.found.append({"target": target, "measured": measured, "pass": passed})


def verdicts(rows: list[dict[str, Any]], targets: dict[str, float]) -> list[dict[str, Any]]:
    """The streaming issue's targets from the runs of this call; "not measured" (pass and measured None, with the
    runs that did not happen or failed under `missing`) where a run they need is not there to measure."""
    judged = Verdicts(rows)
    runs, verdict, found = judged.runs, judged.add, judged.found
    hot = runs.get(INMEMORY_HOT)

    goal = targets["workers_vs_inmemory"]
    for name in WORKER_RUNS:

        def workers(name: str = name) -> tuple[str, bool]:
            ratio = round(runs[name]["wall_s"] / hot["wall_s"], 3)
            return f"{runs[name]['wall_s']} s / {hot['wall_s']} s = {ratio}x", ratio <= goal

        verdict(f"{name} <= {goal}x in-memory W1 hot", [name, INMEMORY_HOT], workers)

    slack = targets["inmemory_over_gpu_work_s"]

    def inmemory() -> tuple[str, bool]:
        over = round(hot["wall_s"] - hot["gpu_work_s"], 1)
        return f"{hot['wall_s']} s, GPU work {hot['gpu_work_s']} s: +{over} s", over <= slack

    verdict(f"in-memory W1 hot <= its GPU work + {slack} s", [INMEMORY_HOT], inmemory)

    extra = targets["warm_oneshot_over_inmemory_s"]

    def oneshot() -> tuple[str, bool]:
        over = round(runs[WARM_ONESHOT]["wall_s"] - hot["wall_s"], 1)
        return f"{runs[WARM_ONESHOT]['wall_s']} s, in-memory {hot['wall_s']} s: +{over} s", over <= extra

    verdict(f"one-shot W1, warm compile cache <= in-memory hot + {extra} s", [WARM_ONESHOT, INMEMORY_HOT], oneshot)

    per_window_goal = targets["window_vs_gpu_work"]

    def multiwindow() -> tuple[str, bool | None]:
        row = runs[MULTIWINDOW]
        if row["windows"] < 3:
            return f"{row['windows']} windows in the run's timeline, not 3", False
        seconds = row["s_per_window_gpu"]
        ratio = round(seconds / hot["gpu_work_s"], 3)
        measured = f"{seconds} s a window ({row['windows']} windows), one window's GPU work {hot['gpu_work_s']} s"
        return f"{measured}: {ratio}x", ratio <= per_window_goal

    verdict(
        f"multi-window: GPU stream s/window <= {per_window_goal}x one window's GPU work",
        [MULTIWINDOW, INMEMORY_HOT],
        multiwindow,
    )

    archive_goal = targets["archive_vs_serial_inmemory"]

    def archive() -> tuple[str, bool]:
        row = runs[ARCHIVE]
        serial = round(3600 / hot["wall_s"], 1)  # clips per hour, one in-memory run after another
        ratio = round(row["clips_per_hour"] / serial, 3)
        measured = (
            f"{row['clips_per_hour']} clips/h ({row['clips_done']} clips in {row['wall_s']} s), serial in-memory "
            f"{serial} clips/h ({row['clips']} x {hot['wall_s']} s = {round(row['clips'] * hot['wall_s'], 1)} s): "
            f"{ratio}x"
        )
        return measured, ratio >= archive_goal and row["clips_done"] == row["clips"]

    verdict(f"archive clips/h >= {archive_goal}x serial in-memory", [ARCHIVE, INMEMORY_HOT], archive)

    busy_goal = targets["archive_vs_gpu_work"]

    def archive_busy() -> tuple[str, bool]:
        row = runs[ARCHIVE]
        ceiling = round(3600 / hot["gpu_work_s"], 1)  # clips per hour were the GPU never to wait
        ratio = round(row["clips_per_hour"] / ceiling, 3)
        return (
            f"{row['clips_per_hour']} clips/h, 3600 / {hot['gpu_work_s']} s = {ceiling}: {ratio}x",
            ratio >= busy_goal,
        )

    verdict(f"archive clips/h >= {busy_goal}x 3600 / one clip's GPU work", [ARCHIVE, INMEMORY_HOT], archive_busy)

    head_goal = targets["workers_head_s"]
    for name in WORKER_RUNS:
        verdict(f"{name}: first GPU item within {head_goal} s", [name], lambda n=name: _head(runs[n], head_goal))
    verdict(
        f"one-shot W1 warm: first GPU item within {targets['oneshot_head_s']} s",
        [WARM_ONESHOT],
        lambda: _head(runs[WARM_ONESHOT], targets["oneshot_head_s"]),
    )
    for name in (*WORKER_RUNS, WARM_ONESHOT):
        limit = targets["tail_s"]
        verdict(
            f"{name}: tail after the last GPU item within {limit} s", [name], lambda n=name, g=limit: _tail(runs[n], g)
        )
    return found


def _head(row: dict[str, Any], limit: float) -> tuple[str, bool | None]:
    head = row.get("head_s")
    return (f"{head} s", head <= limit) if head is not None else ("no GPU item in the timeline", False)


def _tail(row: dict[str, Any], limit: float) -> tuple[str, bool | None]:
    tail = row.get("tail_s")
    return (f"{tail} s", tail <= limit) if tail is not None else ("no GPU item in the timeline", False)
