"""The device check's `same-bytes` run set: one clip through every kind of process that computes it, one md5 expected.

    python bench/device_check.py --runs same-bytes [--same-workload W2] [--parallel 3]

In one call, each run with a store and an output folder of its own, the README's GPU command on the clip:

- two one-shot runs (two processes, tiles in their own threads; `K6VSR_WARM_WORKERS=off`);
- a run on warm workers (`k6vsr workers start --model ...`, the run, `k6vsr workers stop`);
- with more than one GPU, a run with `--gpus` (one worker process per GPU);
- three runs killed with SIGKILL (`tests/fault_harness.py`) before the first denoise, before the first tile
  decode (the denoised latents stored: another process decodes them) and after the first segment was written but
  not committed, each resumed by the same command;
- the in-memory runner in a process of its own, on a bundle loaded and compiled as the command does, run twice;
- the same runner with `K6VSR_DETERMINISTIC=0` (the libraries' kernel choices by timing), run twice: the second
  runs of the two, hot, time what determinism costs (`k6vsr_core.device.determinism`).

The first group runs `--parallel` at a time (their md5s do not depend on it); the two timed runners run after them,
alone. Every row carries its md5; the verdict is one md5 for all of them but the non-deterministic runner's.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.check_kit import Check

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "fault_harness.py"
GROUP = "same-bytes"
# Where a run is killed (`tests/fault_harness.py` points): during denoise, during decode, during segment writing.
KILLS = {
    "denoise": "kill@denoise:times=1",
    "decode": "kill@decode:times=1",
    "segment": "kill@segment:times=1",
}
NONDETERMINISTIC = "same-runner-nondeterministic"
RUNNER_REPEATS = 2


@dataclass(frozen=True)
class Step:
    """One command of a job: the README's command (`upscale`), another `k6vsr` command (`cli`), or the runner."""

    label: str
    kind: str = "upscale"
    args: tuple[str, ...] = ()  # `cli`: the command's arguments; `upscale`: flags added to the README's
    env: dict[str, str] = field(default_factory=dict)
    faults: tuple[str, ...] = ()
    run: str | None = None  # steps of one job that share a store and an output folder (a kill and its resume)
    killed: bool = False  # the step is expected to die of its fault


def jobs(bundle: Path, gpus: int) -> list[list[Step]]:
    """The run set's jobs, each a list of steps run in order; jobs are independent of one another."""
    alone = {"K6VSR_WARM_WORKERS": "off"}  # a one-shot computes in its own process, whatever else runs
    planned = [[Step("same-oneshot-1", env=alone)], [Step("same-oneshot-2", env=alone)]]
    planned.append(
        [
            Step("same-workers-start", kind="cli", args=("workers", "start", "--model", str(bundle))),
            Step("same-workers"),
            Step("same-workers-stop", kind="cli", args=("workers", "stop")),
        ]
    )
    if gpus > 1:
        planned.append([Step("same-gpus", args=("--gpus",), env=alone)])
    for point, spec in KILLS.items():
        run = f"kill-{point}"
        planned.append(
            [
                Step(f"same-killed-{point}", env=alone, faults=(spec,), run=run, killed=True),
                Step(f"same-resumed-{point}", env=alone, run=run),
            ]
        )
    return planned


def timed_runners() -> list[Step]:
    """The in-memory runner with the kernel settings and without, after the others, alone on the device."""
    return [
        Step("same-runner", kind="runner"),
        Step(NONDETERMINISTIC, kind="runner", env={"K6VSR_DETERMINISTIC": "0"}),
    ]


def fault_argv(specs: tuple[str, ...], state: Path, command_args: list[str]) -> list[str]:
    """The README's command through the fault harness: `command_args` are the `k6vsr` arguments."""
    return [sys.executable, str(HARNESS), "--state", str(state), *specs, "--", *command_args]


def run_same_bytes(check: Check, workload: str, parallel: int) -> None:
    """Every job, `parallel` at a time, then the timed runners alone; rows go into `check`."""
    check.cli("same-server-start", "server", "start")  # one Prefect server for every run, before they race for it
    gpus = _gpu_count()
    planned = jobs(check.work / "bundle", gpus)
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        for future in [pool.submit(_run_job, check, workload, job) for job in planned]:
            future.result()
    for step in timed_runners():
        if check.left() < 60:
            check.log(f"{step.label}: not run, the deadline is near")
            continue
        _runner(check, workload, step)


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def _run_job(check: Check, workload: str, job: list[Step]) -> None:
    for step in job:
        if check.left() < 60:
            check.log(f"{step.label}: not run, the deadline is near")
            return
        if step.kind == "cli":
            check.cli(step.label, *step.args)
            continue
        run = step.run or step.label
        state = check.work / f"faults-{run}"
        row = check.upscale(
            step.label,
            workload,
            note="killed by " + ", ".join(step.faults) if step.faults else "resumed" if step.run else "",
            extra_env=step.env,
            extra_args=step.args,
            run=run,
            fresh=not (step.run and not step.faults),  # a resume keeps the store its killed run left
            wrap=(lambda argv, s=step, st=state: fault_argv(s.faults, st, argv[3:])) if step.faults else None,
            group=GROUP,
        )
        if step.faults:
            from tests.fault_harness import fired

            row["fired"] = [name for name, _pid in fired(state)] if state.exists() else []
            row["killed_as_expected"] = row["rc"] == -9 and bool(row["fired"])
            check.save()


def runner_report(
    check: Check, label: str, workload: str, env: dict[str, str] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The in-memory runner in a child process (`--runner-child`) on `workload`'s clip: the command's result and the
    child's report (empty when it printed none: it failed)."""
    argv = [
        sys.executable,
        str(ROOT / "bench" / "device_check.py"),
        "--runner-child",
        str(check.clip(workload)),
        str(check.work / f"out-{label}"),
    ]
    result = check.command(label, argv, {**check.env, **(env or {})})
    lines = [line for line in result["stdout"].splitlines() if line.startswith("{")]
    return result, json.loads(lines[-1]) if lines else {}


def _runner(check: Check, workload: str, step: Step) -> None:
    """The in-memory runner in a child process, its rows: one per repeat."""
    result, report = runner_report(check, step.label, workload, step.env)
    for index, repeat in enumerate(report.get("repeats", [])):
        check.add_row(
            {
                "run": f"{step.label}-{index + 1}",
                "workload": workload,
                "group": GROUP,
                "note": ("hot" if index else "first (compiles)") + ("; K6VSR_DETERMINISTIC=0" if step.env else ""),
                "wall_s": repeat["seconds"],
                "rc": result["rc"],
                "peak_reserved_gib": repeat.get("peak_reserved_gib"),
                "md5": repeat["md5"],
                "deterministic": report.get("deterministic"),
            }
        )
    if not report:
        error = result["stderr"].strip().splitlines()[-1:]
        check.add_row(
            {
                "run": step.label,
                "workload": workload,
                "group": GROUP,
                "wall_s": result["wall_s"],
                "rc": result["rc"],
                "md5": None,
                "error": error,
            }
        )


def runner_child(clip: Path, out_dir: Path) -> int:
    """Load and compile the bundle as the command does, run the in-memory runner `RUNNER_REPEATS` times on the
    README command's parameters; print one JSON line: each repeat's seconds, md5, peak reserved memory and the
    runner's per-stage busy seconds."""
    sys.path.insert(0, str(ROOT))
    import torch

    from bench.check_kit import as_run, md5, readme_gpu_command
    from entrypoints.cli import build_parser
    from entrypoints.command_inputs import model_from
    from entrypoints.request_inputs import params_from
    from k6vsr_core.model.bundle import load_bundle
    from k6vsr_core.model.fast import compile_bundle
    from k6vsr_core.model.runner import upscale
    from tasks.model_cache import resolve_device

    out_dir.mkdir(parents=True, exist_ok=True)
    args = build_parser().parse_args(as_run(readme_gpu_command(), clip, out_dir)[3:])
    params, spec = params_from(args), model_from(args)
    device = torch.device(resolve_device(spec.device))
    bundle = load_bundle(spec.model, spec.revision, model_id=spec.model_id, device=device)
    path = compile_bundle(bundle, compiled=spec.compile)
    repeats = []
    for index in range(RUNNER_REPEATS):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        output = out_dir / f"runner-{index + 1}.mp4"
        started = time.perf_counter()
        result = upscale(clip, output, bundle, params, memory=spec.memory)
        seconds = round(time.perf_counter() - started, 2)
        peak = round(torch.cuda.max_memory_reserved(device) / 2**30, 2) if device.type == "cuda" else None
        timings = {stage: round(busy, 2) for stage, busy in result.timings.items()}
        repeats.append({"seconds": seconds, "md5": md5(output), "peak_reserved_gib": peak, "timings": timings})
    memory = bundle.memory.summary() if bundle.memory is not None else None
    print(json.dumps({"deterministic": path.deterministic, "memory": memory, "repeats": repeats}))
    return 0


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One md5 for every run of the set (the non-deterministic runner aside), the kills fired, and the cost."""
    same = [row for row in rows if row.get("group") == GROUP and not row["run"].startswith(NONDETERMINISTIC)]
    with_output = [row for row in same if "fired" not in row]  # a killed run has none; its resume has
    found: list[dict[str, Any]] = []
    if with_output:
        md5s = {row["md5"] for row in with_output}
        groups = {digest: [row["run"] for row in with_output if row["md5"] == digest] for digest in md5s}
        measured = "; ".join(f"{digest}: {', '.join(runs)}" for digest, runs in groups.items())
        found.append(
            {
                "target": f"same bytes: one md5 for every process ({len(with_output)} runs)",
                "measured": measured,
                "pass": len(md5s) == 1 and None not in md5s,
            }
        )
    for row in same:
        if "fired" in row:
            found.append(
                {
                    "target": f"{row['run']}: killed by its fault",
                    "measured": ", ".join(row["fired"]) or "did not fire",
                    "pass": bool(row.get("killed_as_expected")),
                }
            )
    hot = {row["run"]: row for row in rows if row["run"] in ("same-runner-2", f"{NONDETERMINISTIC}-2")}
    if len(hot) == 2 and all(row.get("rc") == 0 for row in hot.values()):
        ratio = round(hot["same-runner-2"]["wall_s"] / hot[f"{NONDETERMINISTIC}-2"]["wall_s"], 3)
        found.append(
            {
                "target": "cost of determinism: hot in-memory runner with the kernel settings / without",
                "measured": ratio,
                "pass": None,  # measured, to decide on; no target
            }
        )
    return found


def main_child(argv: list[str]) -> int:
    """`device_check.py --runner-child CLIP OUT_DIR`."""
    if len(argv) != 2:
        raise SystemExit("usage: device_check.py --runner-child CLIP OUT_DIR")
    return runner_child(Path(argv[0]), Path(argv[1]))
