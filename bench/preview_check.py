"""The device check's `preview` run: `k6vsr preview`'s estimate against the whole run it estimates, on the GPU.

As a user runs them, on the multi-window run's clip (W1's size, three windows) and the check's bundle: `k6vsr
preview CLIP --windows 1` with the README GPU command's flags, in a store of its own, then the README's GPU command
(`k6vsr upscale`) on the same clip and store, which finds the previewed window blended and computes the others. The
preview's estimate of what is left (`estimate.seconds_left`: the whole run less the windows it already holds) is set
against the run's wall time, its output bytes against the output's size and its peak store against the store's
size, sampled while the run lasts.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.streaming import ONE_SHOT, Verdicts

if TYPE_CHECKING:
    from bench.check_kit import Check

WORKLOAD = "W1-long"  # the multi-window run's clip
PREVIEW = f"preview-{WORKLOAD}"
RUN = f"preview-run-{WORKLOAD}"  # the whole run after the preview, on its store
PREVIEW_WINDOWS = 1
STORE_SAMPLE_S = 0.5  # how often the store's size is sampled while the run lasts


class StorePeak:
    """The largest size of the files under a folder, sampled every `STORE_SAMPLE_S` while the `with` block lasts
    (a run deletes a window's intermediates once its segments are written: its end size is not its peak)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bytes = 0
        self._stop = threading.Event()

    def __enter__(self) -> StorePeak:
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.bytes = max(self.bytes, tree_bytes(self.root))

    def _poll(self) -> None:
        while True:
            self.bytes = max(self.bytes, tree_bytes(self.root))
            if self._stop.wait(STORE_SAMPLE_S):
                return


def tree_bytes(root: Path) -> int:
    """The bytes of the files under `root`; files that go while it is walked are not counted."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name), follow_symlinks=False).st_size
            except OSError:
                continue
    return total


def preview_argv(upscale: list[str]) -> list[str]:
    """The README's command, as the check runs it (`as_run`), as a preview of `PREVIEW_WINDOWS` windows with its
    summary as JSON on stdout."""
    if upscale[3] != "upscale":
        raise SystemExit(f"the README's GPU command is not `k6vsr upscale ...`: {upscale[3:]}")
    return [*upscale[:3], "preview", *upscale[4:], "--windows", str(PREVIEW_WINDOWS), "--json"]


def preview_summary(stdout: str) -> dict[str, Any] | None:
    """The summary `k6vsr preview --json` printed (the last JSON object on stdout); None if there is none."""
    start = stdout.find("{\n")
    while start != -1:
        try:
            return json.loads(stdout[start:])
        except ValueError:
            start = stdout.find("{\n", start + 1)
    return None


def run_preview(check: Check) -> None:
    """The preview and then the whole run on its store; a row for each, the second with the estimate beside what
    the run took."""
    from bench.check_kit import as_run, readme_gpu_command

    store = check.work / f"store-{PREVIEW}"
    preview_out, run_out = check.work / f"out-{PREVIEW}", check.work / f"out-{RUN}"
    for fresh in (store, preview_out, run_out):
        shutil.rmtree(fresh, ignore_errors=True)
    clip = check.clip(WORKLOAD)
    argv = preview_argv(as_run(readme_gpu_command(), clip, preview_out))
    note = f"k6vsr preview --windows {PREVIEW_WINDOWS}"
    row = check.measure(PREVIEW, WORKLOAD, note, argv, ONE_SHOT, store, preview_out, add=False, stdout=True)
    stdout = row.pop("stdout")
    summary = preview_summary(stdout) if row["rc"] == 0 else None
    estimate = (summary or {}).get("estimate")
    row["estimate"] = estimate
    row["rates"] = (summary or {}).get("rates")  # what the estimate is made of: head, ingest, pace, segments
    if row["rc"] == 0 and estimate is None:
        row["rc"], row["error"] = 1, ["the preview printed no estimate"]  # nothing to judge the run against
    elif estimate is not None:
        row["note"] += f"; windows {summary['windows']}: whole run {estimate['seconds']} s, "
        row["note"] += f"left {estimate['seconds_left']} s"
    check.add_row(row)
    if row["rc"] != 0:
        return
    run_argv = as_run(readme_gpu_command(), clip, run_out)
    with StorePeak(store) as disk:
        note = "the README's command on the preview's store"
        done = check.measure(RUN, WORKLOAD, note, run_argv, ONE_SHOT, store, run_out, add=False)
    outputs = sorted(run_out.glob("*.mp4"))
    actual = {
        "seconds": done["wall_s"],
        "output_bytes": outputs[-1].stat().st_size if outputs else None,
        "peak_store_bytes": disk.bytes,
    }
    done["estimate"], done["actual"] = estimate, actual
    done["estimate_vs_run"] = ratios(estimate, actual)
    done["note"] += "; estimate / actual: " + ", ".join(f"{k} {v}x" for k, v in done["estimate_vs_run"].items())
    check.add_row(done)


def ratios(estimate: dict[str, Any], actual: dict[str, Any]) -> dict[str, float | None]:
    """Estimate over actual: the time left after the previewed windows against the run's wall time, the output's
    bytes and the store's peak."""
    pairs = {
        "seconds": (estimate["seconds_left"], actual["seconds"]),
        "output_bytes": (estimate["output_bytes"], actual["output_bytes"]),
        "peak_store_bytes": (estimate["peak_store_bytes"], actual["peak_store_bytes"]),
    }
    return {key: round(e / a, 3) if e is not None and a else None for key, (e, a) in pairs.items()}


def verdicts(rows: list[dict[str, Any]], targets: dict[str, float]) -> list[dict[str, Any]]:
    """The preview's time estimate within `preview_estimate_error` of the run; its disk estimates measured (no
    target is set for them)."""
    judged = Verdicts(rows)
    error = targets["preview_estimate_error"]

    def time() -> tuple[str, bool]:
        run = judged.runs[RUN]
        ratio = run["estimate_vs_run"]["seconds"]
        measured = f"{run['estimate']['seconds_left']} s / {run['actual']['seconds']} s = {ratio}x"
        return measured, ratio is not None and round(abs(ratio - 1), 3) <= error

    def disk() -> tuple[str, None]:
        run = judged.runs[RUN]
        return ", ".join(f"{key} {run['estimate_vs_run'][key]}x" for key in ("output_bytes", "peak_store_bytes")), None

    judged.add(f"preview estimate within {error:.0%} of the run", [PREVIEW, RUN], time)
    judged.add("preview disk estimate / the run's (output, peak store)", [PREVIEW, RUN], disk)
    return judged.found
