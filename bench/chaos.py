"""A fault campaign at archive scale: random kills of the command, its workers and the local Prefect server.

    nice -n 10 python bench/chaos.py --clips 50 --faults 30 [--seed 1] [--workers 2] [--fake-ms 5] [--work DIR]
        [--append]

What runs: N synthetic clips (`archive_scale.make_clips`: 64x64, every fifth two windows, the others one frame)
through real `k6vsr archive` commands on the CPU with the tiny random bundle and the bench-only stand-in for the
networks (`bench/fake_model.py`), reporting to the local Prefect server the command starts itself (its state folder
in the work folder). First one clean archive, the reference; then the campaign: the same archive into a store and an
output folder of its own, rerun until it finishes, each run of the command given one fault at a random moment (a
seeded `random.Random`): SIGKILL or SIGTERM of the command, of one of its worker processes (with `--workers` above
1), or of the local Prefect server (the next command starts it again, as the README says). A run of the command
that ends before its moment gets no fault. Once every fault is spent, the last run must finish, and then:

- every output is byte-identical to the clean archive's;
- no finished item was computed twice: each line of a run's `timeline.jsonl` is one item's completion record
  written, so an item with two lines was computed again after it was done;
- no stray process: nothing started by the campaign's commands is alive once they have ended (the local server,
  meant to last, aside);
- no flow run is left Running (nor Pending) on the server;
- the archive's manifest lists every clip done, with the clean archive's run keys and outputs;
- a run that fails says why in its last line (`k6vsr: ...`), never as an error nothing describes.

It prints the faults, a summary table and the result as JSON (`--json-out`); `--append` adds the table to
bench/RESULTS.md. `tests/flows/test_chaos.py` runs a short campaign of the same code.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import archive_scale  # noqa: E402 - the bench folder is put on the path above

from bench import fake_model  # noqa: E402

TARGETS = ("command", "worker", "server")
FINISHED = ("done", "reused")  # a manifest row's status once its clip's output is written (by this run or before)
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}
# A run of the command that outlives these after its fault (or, with no fault left, at all) is a hang: a finding.
AFTER_FAULT_S = 600.0
UNEXPECTED = "(rerun with --debug for details)"  # the command's word for an error nothing describes
LAST_RUN_S = 1800.0


@dataclass
class Campaign:
    work: Path
    clips: int = 50
    faults: int = 30
    seed: int = 1
    workers: int = 1
    fake_ms: float = 5.0
    targets: tuple[str, ...] = TARGETS
    # Measure the command's fixed cost with a rerun of the finished clean archive; without it (a short campaign) its
    # start before any work stands for it.
    measure_fixed: bool = True


@dataclass
class Fault:
    run: int  # which run of the command it hit (1 = the first)
    at_s: float  # seconds into that run
    target: str
    signal: str
    pid: int
    exit_code: int | None = None  # the command's, in that run
    done_before: int = 0  # clips done in the manifest when it hit
    done_after: int = 0  # and when that run ended


@dataclass
class Outcome:
    clean_s: float = 0.0
    fixed_s: float = 0.0  # a rerun of the finished clean archive: what every run of the command costs
    start_s: float = 0.0  # from the clean archive's start to its first clip's run folder: before any work
    campaign_s: float = 0.0
    runs: int = 0
    faults: list[Fault] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    outputs: int = 0
    identical: int = 0
    different: list[str] = field(default_factory=list)
    recomputed: dict[str, int] = field(default_factory=dict)  # `<run key>/<stage>/<item>`: extra computations
    strays: list[str] = field(default_factory=list)
    flow_runs_left: dict[str, int] = field(default_factory=dict)
    manifest_problems: list[str] = field(default_factory=list)
    # Runs that failed without a clear last line (a `k6vsr:` line that is not an unexpected error's): the log's tail.
    unclear: list[str] = field(default_factory=list)

    @property
    def survived(self) -> bool:
        return (
            not self.hangs
            and self.outputs > 0
            and self.identical == self.outputs
            and not self.different
            and not self.recomputed
            and not self.strays
            and not any(self.flow_runs_left.values())
            and not self.manifest_problems
            and not self.unclear
        )


def environment(work: Path, fake_ms: float) -> dict[str, str]:
    env = {
        **os.environ,
        "PREFECT_HOME": str(work / "client-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "K6VSR_SERVER_HOME": str(work / "server"),
        "K6VSR_WORKERS_HOME": str(work / "workers"),
        "K6VSR_WARM_WORKERS": "off",
        **fake_model.environment(fake_ms),
        "PYTHONPATH": str(ROOT),
    }
    env.pop("PREFECT_API_URL", None)  # the command's own local server, which the campaign kills
    return env


def archive_command(campaign: Campaign, out: Path, store: Path) -> list[str]:
    command = archive_scale.archive_command(campaign.work / "in", out, store, campaign.work / "tiny")
    return [*command, "--workers", str(campaign.workers)] if campaign.workers > 1 else command


def server_pid(env: dict[str, str]) -> int | None:
    """The local server's process, from its state folder (None while none runs)."""
    record = Path(env["K6VSR_SERVER_HOME"]) / "server.json"
    try:
        return int(json.loads(record.read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def server_url(env: dict[str, str]) -> str | None:
    record = Path(env["K6VSR_SERVER_HOME"]) / "server.json"
    try:
        return str(json.loads(record.read_text())["url"])
    except (OSError, ValueError, KeyError):
        return None


def finished(out: Path) -> int:
    return sum(1 for row in archive_scale.manifest_rows(out) if row["status"] in FINISHED)


def workers_of(pid: int) -> list[int]:
    """The command's worker processes: its descendants (Dask's nannies and workers)."""
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def session_members(session: int) -> list[str]:
    """Live processes of a session (each run of the command starts one of its own): what it left behind."""
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if os.getsid(process.pid) == session and process.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(f"{process.pid} {' '.join(process.info['cmdline'] or [])[:160]}")
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def _kill_session(session: int) -> None:
    try:
        os.killpg(session, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Runner:
    """Runs of the archive command, each in a session of its own, logged to `logs/<name>-<n>.log`."""

    def __init__(self, campaign: Campaign, env: dict[str, str]) -> None:
        self.campaign, self.env = campaign, env
        self.logs = campaign.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.count = 0
        self.log_path = self.logs / "none.log"

    def start(self, name: str, out: Path, store: Path) -> subprocess.Popen:
        self.count += 1
        self.log_path = self.logs / f"{name}-{self.count:03d}.log"
        log = self.log_path.open("w")
        return subprocess.Popen(
            archive_command(self.campaign, out, store),
            env=self.env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def finish(self, process: subprocess.Popen, timeout: float, outcome: Outcome) -> int | None:
        """Its exit code, None if it hung (then its session is killed); what its session left alive is a stray."""
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            outcome.hangs.append(f"run {self.count} still running {timeout:g} s on")
            _kill_session(process.pid)
            process.wait()
            return None
        time.sleep(1.0)  # a child that exits with its parent has a moment to go
        left = session_members(process.pid)
        if left:
            outcome.strays += [f"run {self.count}: {entry}" for entry in left]
            _kill_session(process.pid)
        if process.returncode > 0:  # not a SIGKILL of the command, which leaves no word
            last = _last_line(self.log_path)
            if not last.startswith("k6vsr: ") or UNEXPECTED in last:
                outcome.unclear.append(f"run {self.count} ended {process.returncode}: {last}")
        return process.returncode


def _last_line(log: Path) -> str:
    lines = log.read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""


def clean_run(campaign: Campaign, runner: Runner, outcome: Outcome) -> None:
    """The reference archive, and what it cost; kept in the work folder (`clean.json`) for the next campaign there."""
    work = campaign.work
    kept = work / "clean.json"
    rows = archive_scale.manifest_rows(work / "clean-out")
    if kept.exists() and len(rows) == campaign.clips and all(row["status"] in FINISHED for row in rows):
        timings = json.loads(kept.read_text())
        outcome.clean_s, outcome.fixed_s, outcome.start_s = timings["clean_s"], timings["fixed_s"], timings["start_s"]
        return
    started = time.perf_counter()
    process = runner.start("clean", work / "clean-out", work / "clean-store")
    while process.poll() is None and not any((work / "clean-store" / "runs").glob("*")):
        time.sleep(0.5)
    outcome.start_s = time.perf_counter() - started
    rc = runner.finish(process, LAST_RUN_S, outcome)
    outcome.clean_s = time.perf_counter() - started
    if rc != 0:
        raise RuntimeError(f"the clean archive ended {rc}; see {runner.logs}")
    if not campaign.measure_fixed:
        outcome.fixed_s = outcome.start_s
        return
    started = time.perf_counter()
    process = runner.start("clean-rerun", work / "clean-out", work / "clean-store")
    rc = runner.finish(process, LAST_RUN_S, outcome)
    outcome.fixed_s = time.perf_counter() - started
    if rc != 0:
        raise RuntimeError(f"the rerun of the clean archive ended {rc}; see {runner.logs}")
    kept.write_text(json.dumps({"clean_s": outcome.clean_s, "fixed_s": outcome.fixed_s, "start_s": outcome.start_s}))


def inject(campaign: Campaign, runner: Runner, outcome: Outcome, rng: random.Random) -> None:
    """Runs of the command until every fault is spent and a run finishes the archive."""
    work = campaign.work
    out, store = work / "out", work / "store"
    targets = [t for t in campaign.targets if t != "worker" or campaign.workers > 1]
    # A fault's moment: anywhere in the command's start (imports, the server, the workers, the plan) or in a share of
    # the work left, so that the runs together still finish the archive; in a run of a finished archive, anywhere in
    # it.
    work_s = max(1.0, outcome.clean_s - outcome.start_s)
    started = time.perf_counter()
    runs_left = 4 * campaign.faults + 10  # a campaign that makes no progress ends, as a finding
    while runs_left:
        runs_left -= 1
        process = runner.start("chaos", out, store)
        run_started = time.perf_counter()
        hits: list[Fault] = []
        # Faults one after another while the command runs: a killed worker or server leaves it running (or it ends
        # of its own), a killed command ends the run.
        while len(outcome.faults) < campaign.faults:
            left = work_s * (1.0 - finished(out) / campaign.clips)
            before = outcome.start_s if left > 0 else outcome.fixed_s
            at = rng.uniform(0.5, before + min(left, 2.0 * work_s / campaign.faults))
            target, name = rng.choice(targets), rng.choice(sorted(SIGNALS))
            try:
                process.wait(timeout=at)
                break  # it ended before the moment
            except subprocess.TimeoutExpired:
                pass
            pid = {
                "command": process.pid,
                "server": server_pid(runner.env),
                "worker": rng.choice(workers_of(process.pid) or [None]),
            }[target]
            if pid is None or pid in {hit.pid for hit in hits}:
                continue  # no such process at this moment (or one this run already hit, perhaps still exiting)
            done = finished(out)
            try:
                os.kill(pid, SIGNALS[name])
            except ProcessLookupError:
                continue
            fault = Fault(runner.count, round(time.perf_counter() - run_started, 2), target, name, pid)
            fault.done_before = done
            outcome.faults.append(fault)
            hits.append(fault)
            if target == "command":
                break
        rc = runner.finish(process, AFTER_FAULT_S if hits else LAST_RUN_S, outcome)
        for fault in hits:
            fault.exit_code = rc
            fault.done_after = finished(out)
            print(f"fault {outcome.faults.index(fault) + 1}: {asdict(fault)}", flush=True)
        if rc == 0 and not hits and len(outcome.faults) >= campaign.faults:
            break
    outcome.campaign_s = time.perf_counter() - started
    outcome.runs = runner.count


def check(campaign: Campaign, runner: Runner, outcome: Outcome) -> None:
    work = campaign.work
    clean = {p.relative_to(work / "clean-out"): p for p in (work / "clean-out").rglob("*.mp4")}
    outcome.outputs = len(clean)
    for relative, path in sorted(clean.items()):
        chaos = work / "out" / relative
        if chaos.is_file() and chaos.read_bytes() == path.read_bytes():
            outcome.identical += 1
        else:
            outcome.different.append(str(relative))
    for run_dir in sorted((work / "store" / "runs").glob("*")):
        seen: dict[tuple[str, str], int] = {}
        timeline = run_dir / "timeline.jsonl"
        for text in timeline.read_text().splitlines() if timeline.exists() else []:
            try:
                line = json.loads(text)
            except ValueError:  # cut short by a kill: its record was not written after it either
                continue
            key = (str(line.get("stage")), str(line.get("item")))
            seen[key] = seen.get(key, 0) + 1
        for (stage, item), count in seen.items():
            if count > 1:
                outcome.recomputed[f"{run_dir.name}/{stage}/{item}"] = count - 1
    clean_rows = {row["relative_path"]: row for row in archive_scale.manifest_rows(work / "clean-out")}
    rows = {row["relative_path"]: row for row in archive_scale.manifest_rows(work / "out")}
    if set(rows) != set(clean_rows) or len(rows) != campaign.clips:
        outcome.manifest_problems.append(f"{len(rows)} rows, {len(clean_rows)} in the clean archive's")
    for name, row in rows.items():
        want = clean_rows.get(name, {})
        if row["status"] not in FINISHED:
            outcome.manifest_problems.append(f"{name}: {row['status']} {row.get('reason', '')[:200]}")
        elif row.get("run_key") != want.get("run_key") or Path(row["output"]).name != Path(want["output"]).name:
            outcome.manifest_problems.append(f"{name}: run key or output differs from the clean archive's")
        elif not Path(row["output"]).is_file():
            outcome.manifest_problems.append(f"{name}: its output {row['output']} is missing")
    outcome.flow_runs_left = flow_runs_left(runner.env)


def flow_runs_left(env: dict[str, str]) -> dict[str, int]:
    """Flow runs the server still shows Running or Pending."""
    url = server_url(env)
    if url is None:
        return {"server not running": 1}
    left = {}
    for state in ("RUNNING", "PENDING"):
        body = json.dumps({"flow_runs": {"state": {"type": {"any_": [state]}}}}).encode()
        request = urllib.request.Request(f"{url}/flow_runs/count", data=body, method="POST")
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=60) as response:
            left[state.lower()] = int(json.loads(response.read()))
    return left


def server_command(env: dict[str, str], action: str) -> None:
    """`k6vsr server start|stop` on the campaign's local server."""
    command = [sys.executable, "-m", "entrypoints.cli", "server", action]
    subprocess.run(command, env=env, cwd=ROOT, capture_output=True, timeout=300)


def run_campaign(campaign: Campaign) -> Outcome:
    from k6vsr_core.model.tiny_bundle import make_tiny_bundle

    work = campaign.work
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "tiny").exists():
        make_tiny_bundle(work / "tiny")
    archive_scale.make_clips(work / "in", campaign.clips)
    env = environment(work, campaign.fake_ms)
    runner = Runner(campaign, env)
    outcome = Outcome()
    try:
        # Started first, so that the clean archive's time is its work (the campaign's runs restart it as they must).
        server_command(env, "start")
        clean_run(campaign, runner, outcome)
        inject(campaign, runner, outcome, random.Random(campaign.seed))
        check(campaign, runner, outcome)
    finally:
        server_command(env, "stop")
    return outcome


def by_kind(faults: list[Any]) -> dict[str, int]:
    """How many faults of each signal and target (`"SIGKILL server": 3`), in the order first met."""
    return dict(Counter(f"{fault.signal} {fault.target}" for fault in faults))


def summary(campaign: Campaign, outcome: Outcome) -> dict[str, object]:
    injected = len(outcome.faults)
    lost = outcome.campaign_s - outcome.clean_s
    return {
        "clips": campaign.clips,
        "faults_injected": injected,
        "faults_survived": injected if outcome.survived else 0,
        "by_target": by_kind(outcome.faults),
        "runs_of_the_command": outcome.runs,
        "outputs_identical": f"{outcome.identical}/{outcome.outputs}",
        "finished_items_computed_twice": sum(outcome.recomputed.values()),
        "stray_processes": len(outcome.strays),
        "flow_runs_left": outcome.flow_runs_left,
        "manifest_problems": len(outcome.manifest_problems),
        "hangs": len(outcome.hangs),
        "failed_runs_without_a_clear_line": len(outcome.unclear),
        "clean_s": round(outcome.clean_s, 1),
        "start_s": round(outcome.start_s, 1),
        "fixed_s_per_run": round(outcome.fixed_s, 1),
        "campaign_s": round(outcome.campaign_s, 1),
        "seconds_lost_per_fault": round(lost / injected, 1) if injected else None,
    }


def report(
    script: str,
    argv: list[str] | None,
    result: dict[str, object],
    faults: list[dict[str, object]],
    problems: Mapping[str, object],
    json_out: Path | None,
) -> None:
    """A campaign's whole result as JSON (printed, and written to `json_out`), then its summary as a table."""
    details = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": archive_scale._commit(),
        "command": shlex.join(["python", f"bench/{script}", *(argv or sys.argv[1:])]),
        "machine": f"{platform.node()}, {os.cpu_count()} cores",
        "summary": result,
        "faults": faults,
        "problems": problems,
    }
    text = json.dumps(details, indent=2)
    print(text)
    if json_out:
        json_out.write_text(text)
    print(table(result))


def table(result: dict[str, object]) -> str:
    rows = "\n".join(f"| {key.replace('_', ' ')} | {value} |" for key, value in result.items())
    return "| measure | value |\n|---|---|\n" + rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clips", type=int, default=50)
    parser.add_argument("--faults", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1, help="worker processes of the command (above 1: killed too)")
    parser.add_argument("--fake-ms", type=float, default=5.0)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument(
        "--reuse-clean", action="store_true", help="take the clean archive (and its times) a kept --work folder holds"
    )
    parser.add_argument("--append", action="store_true", help="append the table to bench/RESULTS.md")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    work = args.work or Path(f"/tmp/k6vsr-chaos-{args.clips}")
    if work.exists() and not args.reuse_clean:
        shutil.rmtree(work)
    for name in ("out", "store"):
        shutil.rmtree(work / name, ignore_errors=True)
    campaign = Campaign(work, args.clips, args.faults, args.seed, args.workers, args.fake_ms)
    outcome = run_campaign(campaign)
    result = summary(campaign, outcome)
    problems = {
        "hangs": outcome.hangs,
        "different": outcome.different,
        "recomputed": outcome.recomputed,
        "strays": outcome.strays,
        "manifest": outcome.manifest_problems,
        "unclear": outcome.unclear,
    }
    report("chaos.py", argv, result, [asdict(fault) for fault in outcome.faults], problems, args.json_out)
    if args.append:
        with (ROOT / "bench" / "RESULTS.md").open("a") as handle:
            handle.write("\n" + table(result) + "\n")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if outcome.survived and len(outcome.faults) >= campaign.faults else 1


if __name__ == "__main__":
    raise SystemExit(main())
