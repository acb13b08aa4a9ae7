"""The device check measures the README's GPU command as the README writes it (the GPU run itself is on the device;
`bench/device_check.py --tiny` runs the same script on the CPU)."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import pytest

from bench import check_kit, device_check, same_bytes, streaming, two_gpus

SAME = hashlib.md5(b"same").hexdigest()


def test_the_check_runs_the_readmes_gpu_command_with_only_the_clip_and_folder_substituted(tmp_path: Path) -> None:
    command = check_kit.readme_gpu_command()
    assert command[0].endswith("k6vsr") and command[1] == "upscale" and "clip.mp4" in command
    argv = check_kit.as_run(command, tmp_path / "w1.mp4", tmp_path / "out")
    assert argv[:3] == [sys.executable, "-m", "entrypoints.cli"]
    expected = [
        str(tmp_path / "w1.mp4") if w == "clip.mp4" else f"{tmp_path / 'out'}/" if w == "out/" else w
        for w in command[1:]
    ]
    assert argv[3:] == expected
    assert "--compile" not in command and "--attention" not in command  # the defaults are what a new user gets


# ------------------------------------------------------------------------------------------------ same bytes


def test_the_same_bytes_set_covers_every_kind_of_process() -> None:
    from tests.fault_harness import Fault

    planned = same_bytes.jobs(Path("/b"), gpus=1)
    labels = [step.label for job in planned for step in job]
    assert labels[:5] == ["same-oneshot-1", "same-oneshot-2", "same-workers-start", "same-workers", "same-workers-stop"]
    assert "same-gpus" not in labels and "same-gpus" in [s.label for j in same_bytes.jobs(Path("/b"), 2) for s in j]
    kills = [job for job in planned if job[0].faults]
    assert [job[0].faults[0].split("@")[1].split(":")[0] for job in kills] == ["denoise", "decode", "segment"]
    for killed, resumed in kills:
        Fault.parse(killed.faults[0])  # the harness accepts it
        assert killed.killed and killed.run == resumed.run and not resumed.faults
    one_shots = [step for job in planned for step in job if step.kind == "upscale" and step.label != "same-workers"]
    assert all(step.env == {"K6VSR_WARM_WORKERS": "off"} for step in one_shots)  # never on the warm workers
    assert [s.env for s in same_bytes.timed_runners()] == [{}, {"K6VSR_DETERMINISTIC": "0"}]


def _check(tmp_path: Path) -> device_check.Check:
    args = argparse.Namespace(work=str(tmp_path / "work"), out=str(tmp_path / "out"), deadline=600.0, tiny=True)
    check = device_check.Check(args)
    check.work.mkdir()
    check.out.mkdir()
    return check


def test_the_same_bytes_runs_reach_their_commands_and_fill_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plumbing with the commands faked: which command each run gets, with which environment and store, and the
    table and verdicts that come out."""
    check = _check(tmp_path)
    monkeypatch.setattr(check, "clip", lambda workload: tmp_path / "clip.mp4")
    monkeypatch.setattr(same_bytes, "_gpu_count", lambda: 2)
    calls: dict[str, tuple[list[str], dict[str, str]]] = {}

    def command(label: str, argv: list[str], env: dict[str, str] | None = None) -> dict:
        env = env or check.env
        calls[label] = (argv, env)
        stdout, rc = "", 0
        if "--runner-child" in argv:
            seconds = 1.0 if "K6VSR_DETERMINISTIC" in env else 1.25
            repeats = [{"seconds": 9.0, "md5": SAME}, {"seconds": seconds, "md5": SAME}]
            stdout = json.dumps({"deterministic": True, "repeats": repeats})
        elif "upscale" in argv:
            if str(same_bytes.HARNESS) in argv:
                state = Path(argv[argv.index("--state") + 1])
                state.mkdir(parents=True, exist_ok=True)
                (state / f"fired-{argv[argv.index('--state') + 2]}-0").write_text("1\n")
                rc = -9
            else:
                out_dir = Path(argv[argv.index("-o") + 1])
                out_dir.mkdir(parents=True, exist_ok=True)
                (out_dir / "clip_sr2x.mp4").write_bytes(b"same")
        return {"label": label, "wall_s": 1.0, "rc": rc, "stdout": stdout, "stderr": ""}

    monkeypatch.setattr(check, "command", command)
    same_bytes.run_same_bytes(check, "W2", parallel=3)
    assert calls["same-server-start"][0][-2:] == ["server", "start"]
    assert calls["same-oneshot-1"][1]["K6VSR_WARM_WORKERS"] == "off"
    assert "K6VSR_WARM_WORKERS" not in calls["same-workers"][1]
    assert calls["same-gpus"][0][-1] == "--gpus"
    killed, resumed = calls["same-killed-decode"], calls["same-resumed-decode"]
    assert killed[0][:2] == [sys.executable, str(same_bytes.HARNESS)] and "kill@decode:times=1" in killed[0]
    assert killed[1]["K6VSR_STORE"] == resumed[1]["K6VSR_STORE"] and str(same_bytes.HARNESS) not in resumed[0]
    assert calls["same-runner-nondeterministic"][1]["K6VSR_DETERMINISTIC"] == "0"
    verdicts = {v["target"]: v for v in check.verdicts()}
    same = verdicts["same bytes: one md5 for every process (9 runs)"]
    assert same["pass"] and same["measured"].startswith(SAME)
    assert all(verdicts[f"same-killed-{point}: killed by its fault"]["pass"] for point in same_bytes.KILLS)
    cost = verdicts["cost of determinism: hot in-memory runner with the kernel settings / without"]
    assert cost["measured"] == 1.25 and cost["pass"] is None
    written = json.loads((check.out / "device-check.json").read_text())
    assert len(written["rows"]) == len(check.rows) and "| measured |" in (check.out / "device-check.md").read_text()


def test_a_different_md5_fails_the_set_and_names_the_runs() -> None:
    rows = [
        {"run": "same-oneshot-1", "group": "same-bytes", "md5": "a"},
        {"run": "same-resumed-decode", "group": "same-bytes", "md5": "b"},
        {"run": "same-killed-decode", "group": "same-bytes", "md5": None, "fired": [], "killed_as_expected": False},
        {"run": "same-runner-nondeterministic-2", "group": "same-bytes", "md5": "c"},  # not promised to match
    ]
    found = {v["target"]: v for v in same_bytes.verdicts(rows)}
    same = found["same bytes: one md5 for every process (2 runs)"]
    assert not same["pass"]
    assert sorted(same["measured"].split("; ")) == ["a: same-oneshot-1", "b: same-resumed-decode"]
    assert found["same-killed-decode: killed by its fault"] == {
        "target": "same-killed-decode: killed by its fault",
        "measured": "did not fire",
        "pass": False,
    }


def test_the_runner_child_is_dispatched_before_the_options() -> None:
    with pytest.raises(SystemExit, match="usage: device_check.py --runner-child CLIP OUT_DIR"):
        device_check.main(["--runner-child", "clip.mp4"])


# ------------------------------------------------------------------------------------------------ streaming

HOT_TIMINGS = {"ingest": 0.4, "encode": 0.9, "denoise": 25.1, "decode": 20.0, "blend": 2.7, "segment": 7.0, "mux": 0.6}


def test_the_archive_run_is_the_readmes_command_as_an_archive(tmp_path: Path) -> None:
    command = check_kit.readme_gpu_command()
    argv = check_kit.as_archive(command, tmp_path / "in", tmp_path / "out")
    upscale = check_kit.as_run(command, tmp_path / "in", tmp_path / "out")
    assert argv[3] == "archive" and argv[4] == str(tmp_path / "in") and argv[5:] == upscale[5:]
    with pytest.raises(SystemExit, match="not `k6vsr upscale"):
        check_kit.as_archive(["k6vsr", "demo"], tmp_path / "in", tmp_path / "out")


def _window_timeline(store: Path, started: float, gpu_ends: list[float]) -> None:
    """A run's timeline with one encode, denoise and decode item per window, ending at `gpu_ends`, and a blend and
    segment after each."""
    folder = store / "runs" / "key"
    folder.mkdir(parents=True)
    lines = [{"stage": "ingest", "item": "all", "start": started + 5, "end": started + 6}]
    for window, end in enumerate(gpu_ends):
        lines += [
            {"stage": "encode", "item": str(window), "start": end - 46, "end": end - 45},
            {"stage": "denoise", "item": f"{window}-0", "start": end - 45, "end": end - 20},
            {"stage": "decode", "item": f"{window}-0", "start": end - 20, "end": end},
            {"stage": "blend", "item": str(window), "start": end, "end": end + 3},
            {"stage": "segment", "item": str(window), "start": end + 3, "end": end + 10},
        ]
    (folder / "timeline.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_the_streaming_runs_reach_their_commands_and_give_the_issues_verdicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The three runs with their commands faked (the real ones are the device's): which command each gets, the
    figures in their rows, and a verdict for each of the streaming issue's targets from runs of the same call."""
    check = _check(tmp_path)
    monkeypatch.setattr(check, "clip", lambda workload: tmp_path / f"{workload}.mp4")
    calls: dict[str, tuple[list[str], dict[str, str]]] = {}
    walls = {"multiwindow-W1": 170.0, "archive-W1": 150.0}

    def command(label: str, argv: list[str], env: dict[str, str] | None = None) -> dict:
        env = env or check.env
        calls[label] = (argv, env)
        stdout = ""
        if "--runner-child" in argv:
            first = {"seconds": 80.0, "md5": SAME, "timings": {**HOT_TIMINGS, "decode": 45.0}}
            stdout = "loading\n" + json.dumps(
                {"repeats": [first, {"seconds": 50.0, "md5": SAME, "timings": HOT_TIMINGS}]}
            )
        elif argv[3] == "upscale":
            _window_timeline(Path(env["K6VSR_STORE"]), time.time(), [time.time() + 50 + 48 * w for w in range(3)])
        elif argv[3] == "archive":
            out_dir = Path(argv[argv.index("-o") + 1])
            out_dir.mkdir(parents=True)
            rows = [{"status": "done", "seconds": 37.0} for _ in Path(argv[4]).iterdir()]
            (out_dir / "k6vsr-archive-manifest.json").write_text(json.dumps({"rows": rows}))
        return {"label": label, "wall_s": walls.get(label, 200.0), "rc": 0, "stdout": stdout, "stderr": ""}

    monkeypatch.setattr(check, "command", command)
    streaming.run_inmemory(check)
    streaming.run_multiwindow(check)
    streaming.run_archive(check, clips=4, max_parallel=2)
    spans = {"encode": [4.0, 5.0, 1], "decode": [9.0, 46.0, 9], "blend": [12.0, 48.0, 1]}
    head_tail = device_check.head_and_tail(spans, 52.0)
    assert head_tail == {"head_s": 4.0, "tail_s": 6.0}
    check.add_row({"run": "workers-W1-1", "workload": "W1", "wall_s": 60.0, "rc": 0, "md5": SAME, "head_s": 6.0})
    check.add_row({"run": "workers-W1-2", "workload": "W1", "wall_s": 52.0, "rc": 0, "md5": SAME, **head_tail})
    check.add_row({"run": "oneshot-W1-warm", "workload": "W1", "wall_s": 66.0, "rc": 0, "md5": SAME, "head_s": 15.0})

    assert calls["inmemory-W1"][0][2:4] == ["--runner-child", str(tmp_path / "W1.mp4")]
    multiwindow, archive = calls["multiwindow-W1"], calls["archive-W1"]
    assert str(tmp_path / "W1-long.mp4") in multiwindow[0] and multiwindow[1]["K6VSR_WARM_WORKERS"] == "off"
    assert archive[0][3:5] == ["archive", str(check.work / "archive-in")] and archive[0][-2:] == ["--max-parallel", "2"]
    assert archive[1]["K6VSR_WARM_WORKERS"] == "off" and archive[1]["K6VSR_STORE"] == str(
        check.work / "store-archive-W1"
    )
    clips = sorted((check.work / "archive-in").iterdir())
    assert len(clips) == 4 and len({clip.read_bytes() for clip in clips}) == 4  # four runs, not one reused thrice

    rows = {row["run"]: row for row in check.rows}
    hot = rows["inmemory-W1-2"]
    assert hot["wall_s"] == 50.0 and hot["gpu_work_s"] == 46.0 and hot["timings"] == HOT_TIMINGS
    assert rows["inmemory-W1-1"]["gpu_work_s"] == 71.0 and "first" in rows["inmemory-W1-1"]["note"]
    window = rows["multiwindow-W1"]
    assert window["windows"] == 3 and window["s_per_window_wall"] == round(170 / 3, 1)
    assert window["s_per_window_gpu"] == round((146 - 4) / 3, 1) and window["stages"]["decode"][2] == 3
    assert rows["archive-W1"]["clips_done"] == 4 and rows["archive-W1"]["clips_per_hour"] == 96.0
    assert rows["archive-W1"]["serial_inmemory_s"] == 200.0 and rows["archive-W1"]["clip_seconds"] == [37.0] * 4

    verdicts = {v["target"]: v for v in check.verdicts()}
    assert verdicts["workers-W1-1 <= 1.05x in-memory W1 hot"]["pass"] is False  # 60 / 50 = 1.2
    assert verdicts["workers-W1-2 <= 1.05x in-memory W1 hot"]["pass"] is True  # 52 / 50 = 1.04
    gpu = verdicts["in-memory W1 hot <= its GPU work + 3.0 s"]
    assert gpu["pass"] is False and gpu["measured"].endswith("+4.0 s")
    assert verdicts["one-shot W1, warm compile cache <= in-memory hot + 15.0 s"]["pass"] is False  # +16 s
    stream = verdicts["multi-window: GPU stream s/window <= 1.05x one window's GPU work"]
    assert stream["pass"] is True and stream["measured"].endswith("1.028x")  # 47.3 / 46
    served = verdicts["archive clips/h >= 1.15x serial in-memory"]
    assert served["pass"] is True and served["measured"].endswith("1.333x")  # 96 / (3600 / 50)
    busy = verdicts["archive clips/h >= 0.9x 3600 / one clip's GPU work"]
    assert busy["pass"] is True and busy["measured"].endswith("1.226x")  # 96 / 78.3
    assert verdicts["workers-W1-1: first GPU item within 5.0 s"]["pass"] is False  # 6 s
    assert verdicts["workers-W1-2: first GPU item within 5.0 s"]["pass"] is True  # 4 s
    assert verdicts["one-shot W1 warm: first GPU item within 15.0 s"]["pass"] is True
    assert verdicts["workers-W1-2: tail after the last GPU item within 5.0 s"]["pass"] is False  # 6 s
    untimed = verdicts["workers-W1-1: tail after the last GPU item within 5.0 s"]
    assert untimed["measured"] == "no GPU item in the timeline"
    assert verdicts["W1: one md5 for every process"]["pass"]  # the in-memory runner's bytes among the command's
    table = (check.out / "device-check.md").read_text()
    assert "| FAIL |" in table and "not measured" not in table


def test_a_target_whose_runs_did_not_happen_or_failed_reads_not_measured(tmp_path: Path) -> None:
    check = _check(tmp_path)
    check.add_row({"run": "inmemory-W1-2", "workload": "W1", "wall_s": 50.0, "rc": 0, "md5": SAME, "gpu_work_s": 48})
    check.add_row({"run": "archive-W1", "workload": "W1 x4", "wall_s": 9.0, "rc": 1, "md5": None, "clips": 4})
    verdicts = {v["target"]: v for v in check.verdicts()}
    assert verdicts["in-memory W1 hot <= its GPU work + 3.0 s"]["pass"] is True
    archive = verdicts["archive clips/h >= 1.15x serial in-memory"]
    assert archive["pass"] is None and archive["measured"] is None and archive["missing"] == ["archive-W1 (exit 1)"]
    workers = verdicts["workers-W1-2 <= 1.05x in-memory W1 hot"]
    assert workers["pass"] is None and workers["missing"] == ["workers-W1-2"]
    table = check.render()
    assert "| workers-W1-2 <= 1.05x in-memory W1 hot | no workers-W1-2 | not measured |" in table
    assert "| no archive-W1 (exit 1) | not measured |" in table
    found = streaming.verdicts([], device_check.TARGETS)
    assert len(found) == 13 and all(v["pass"] is None and v["measured"] is None for v in found)


def test_a_run_cut_at_the_deadline_is_a_row_and_the_deadline_counts_archive_clips(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check = _check(tmp_path)

    def cut(argv: list[str], **kwargs: object) -> None:
        raise subprocess.TimeoutExpired(argv, 30, output=b"started\n", stderr=None)

    monkeypatch.setattr(device_check.subprocess, "run", cut)
    result = check.command("archive-W1", ["k6vsr", "archive"])
    assert result["rc"] == device_check.TIMED_OUT and result["stdout"] == "started\n"
    assert "cut at the check's deadline" in result["stderr"]
    check.deadline = time.monotonic() + 4 * check_kit.COST["archive-clip"] - 10
    assert check.fits("archive-clip", 3) and not check.fits("archive-clip", 4)


def test_the_runner_child_reports_the_runners_stage_timings(
    tmp_path: Path, tiny_bundle_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The in-memory runner in the child, for real on a one-tile, one-frame clip and the tiny bundle on the CPU."""
    from k6vsr_core.media.sample import make_sample_clip

    clip = make_sample_clip(tmp_path / "one.mp4", width=64, height=64, num_frames=1, audio=False)
    monkeypatch.setenv("K6VSR_MODEL", str(tiny_bundle_path))
    assert device_check.main(["--runner-child", str(clip), str(tmp_path / "out")]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    first, hot = report["repeats"]
    assert first["md5"] == hot["md5"] and set(streaming.GPU_STAGES) <= set(hot["timings"])
    assert 0 < streaming.gpu_work(hot["timings"]) <= hot["seconds"]


def test_the_memory_run_reaches_the_memory_bench_on_the_checks_bundle_and_gives_its_verdicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--runs memory`: bench/memory_bench.py with the memory issue's modes on the bundle the check wrote (not a
    second copy), a row per mode, and each mode's cap and time ratio as verdicts."""
    from bench import memory_bench

    check = _check(tmp_path)
    (check.work / "bundle").mkdir()
    seen: list[list[str]] = []

    def mode(seconds: float, reserved: float) -> dict:
        return {"seconds": seconds, "peak_reserved_gib": reserved, "budget": {"budget": "fast", "estimate": None}}

    def fake(label: str, argv: list[str], env: dict[str, str] | None = None) -> dict:
        seen.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True)
        results = {"modes": {"default": mode(60.0, 31.0), "fast-whole": mode(58.0, 44.0), "auto24": mode(75.0, 23.5)}}
        results["modes"]["auto16"] = {"error": "OutOfMemoryError: ..."}
        results["targets"] = memory_bench.summarize(results)
        (out / "memory-bench.json").write_text(json.dumps(results))
        return {"label": label, "wall_s": 200.0, "rc": 0, "stdout": "", "stderr": ""}

    monkeypatch.setattr(check, "command", fake)
    device_check.run_memory(check)
    argv = seen[0]
    assert argv[1].endswith("bench/memory_bench.py") and argv[argv.index("--modes") + 1] == device_check.MEMORY_MODES
    assert Path(argv[argv.index("--work") + 1]) == check.work and "--tiny" in argv
    assert (check.work / "bundle-tiny").resolve() == (check.work / "bundle").resolve()
    rows = {row["run"]: row for row in check.rows}
    assert rows["memory-auto16"]["rc"] == 1 and "OutOfMemoryError" in rows["memory-auto16"]["note"]
    assert rows["memory-default"]["peak_reserved_gib"] == 31.0 and rows["memory-default"]["wall_s"] == 60.0
    verdicts = {v["target"]: v for v in check.verdicts()}
    assert verdicts["memory default: peak reserved <= 32.0 GiB"]["pass"] is True
    assert verdicts["memory default: time vs the whole-tile decode"]["measured"] == round(60 / 58, 3)
    assert verdicts["memory default: time vs the whole-tile decode"]["pass"] is False  # 1.034x > 1.02x
    assert verdicts["memory auto24: time vs the default"]["pass"] is False  # 1.25x > 1.15x
    assert "memory auto16: peak reserved <= 16.0 GiB" not in verdicts  # it failed: no figure to judge...
    assert verdicts["memory-auto16 completes"]["pass"] is False  # ...and the failure is a verdict


# ------------------------------------------------------------------------------------------------ two GPUs


class FakeWorkers:
    """`check.command` for the two-GPU runs: warm workers that start with as many workers as the environment shows
    GPUs, runs that write what the real ones would (outputs, timelines, the archive's manifest), and a kill that a
    nanny answers with a fresh pid."""

    def __init__(self, tmp_path: Path, check: device_check.Check, walls: dict[str, float]) -> None:
        self.tmp_path, self.check, self.walls = tmp_path, check, walls
        self.calls: dict[str, tuple[list[str], dict[str, str]]] = {}
        self.order: list[str] = []
        self.workers: list[dict] = []
        self.killed = threading.Event()
        self.next_pid = 100

    def __call__(self, label: str, argv: list[str], env: dict[str, str] | None = None) -> dict:
        env = env or self.check.env
        self.calls[label] = (argv, env)
        self.order.append(label)
        stdout, rc = "", 0
        if argv[0] == "kill":
            pid = int(argv[-1])
            self.workers = [w if w["pid"] != pid else self._worker(w["gpu"]) for w in self.workers]
            self.killed.set()
        elif argv[3:5] == ["workers", "start"]:
            gpus = env.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")
            self.workers = [self._worker(gpu) for gpu in gpus]
        elif argv[3:5] == ["workers", "stop"]:
            self.workers = []
        elif argv[3:5] == ["workers", "status"]:
            stdout = json.dumps({"running": bool(self.workers), "workers": self.workers}, indent=2)
        elif argv[3] == "upscale":
            self._upscale(label, argv, Path(env["K6VSR_STORE"]))
        elif argv[3] == "archive":
            out_dir = Path(argv[argv.index("-o") + 1])
            out_dir.mkdir(parents=True)
            rows = [{"status": "done", "seconds": 30.0} for _ in Path(argv[4]).iterdir()]
            (out_dir / "k6vsr-archive-manifest.json").write_text(json.dumps({"rows": rows}))
        return {"label": label, "wall_s": self.walls.get(label, 100.0), "rc": rc, "stdout": stdout, "stderr": ""}

    def _worker(self, gpu: str) -> dict:
        self.next_pid += 1
        return {"name": f"worker-{gpu}", "pid": self.next_pid, "gpu": gpu, "models": ["bundle"], "loads": 1}

    def _upscale(self, label: str, argv: list[str], store: Path) -> None:
        now = time.time()
        if label.endswith("multiwindow"):  # one GPU: windows one after another; two: two windows side by side
            _window_timeline(store, now, [now + e for e in ((50, 98, 146) if "one" in label else (50, 52, 74))])
        if label == two_gpus.KILLED:
            folder = store / "runs" / "key"
            folder.mkdir(parents=True)
            writer = self.workers[0]["pid"]
            line = {"stage": "denoise", "item": "0-0", "start": now - 20, "end": now, "pid": writer}
            (folder / "timeline.jsonl").write_text(json.dumps(line) + "\n")
            assert self.killed.wait(10), "the watcher never killed a worker"
        out_dir = Path(argv[argv.index("-o") + 1])
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "clip_sr2x.mp4").write_bytes(b"same")


def _gpu_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: list[str]) -> device_check.Check:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(two_gpus, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(device_check, "WORKLOADS", device_check.TINY_WORKLOADS)  # the archive's clips are made
    args = argparse.Namespace(work=str(tmp_path / "work"), out=str(tmp_path / "out"), deadline=3000.0, tiny=False)
    check = device_check.Check(args)
    check.work.mkdir()
    check.out.mkdir()
    monkeypatch.setattr(check, "clip", lambda workload: tmp_path / f"{workload}.mp4")
    return check


TWO_GPU_WALLS = {
    "one-gpu-W1-1": 130.0,
    "one-gpu-W1-2": 60.0,
    "all-gpus-W1-1": 80.0,
    "all-gpus-W1-2": 32.0,
    "one-gpu-archive": 240.0,
    "all-gpus-archive": 120.0,
}


def test_the_two_gpu_runs_reach_their_commands_and_give_the_issues_verdicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warm workers on the first GPU (every command of the set sees only it), then on both; each part on each set;
    a worker SIGKILLed once the killed run's first denoise item is written; a verdict for each of the issue's
    targets from runs of the same call."""
    check = _gpu_check(tmp_path, monkeypatch, ["0", "1"])
    fake = FakeWorkers(tmp_path, check, TWO_GPU_WALLS)
    monkeypatch.setattr(check, "command", fake)
    two_gpus.run_two_gpus(check, list(two_gpus.PARTS), clips=4, max_parallel=2)

    per_set = ["workers-start", "workers-status", "W1-1", "W1-2", "multiwindow", "archive"]
    assert fake.order == [
        "two-gpus-workers-clear",
        *[f"one-gpu-{label}" for label in per_set],
        "one-gpu-workers-stop",
        *[f"all-gpus-{label}" for label in per_set],
        "all-gpus-status-before-kill",
        "all-gpus-W1-killed",
        "all-gpus-kill",
        "all-gpus-status-after-kill",
        "all-gpus-workers-stop",
    ]
    bundle = str(check.work / "bundle")
    assert fake.calls["one-gpu-workers-start"][0][3:] == ["workers", "start", "--gpus", "--model", bundle]
    assert fake.calls["all-gpus-workers-start"][0][3:] == ["workers", "start", "--gpus", "--model", bundle]
    one_gpu = [label for label in fake.order if label.startswith("one-gpu")]
    assert all(fake.calls[label][1]["CUDA_VISIBLE_DEVICES"] == "0" for label in one_gpu)
    all_gpus = [label for label in fake.order if label.startswith("all-gpus")]
    assert all("CUDA_VISIBLE_DEVICES" not in fake.calls[label][1] for label in all_gpus)
    assert fake.calls["one-gpu-multiwindow"][0][4] == str(tmp_path / "W1-long.mp4")
    assert fake.calls["all-gpus-archive"][0][3:5] == ["archive", str(check.work / "archive-in")]
    assert fake.calls["one-gpu-archive"][0][-2:] == fake.calls["all-gpus-archive"][0][-2:] == ["--max-parallel", "2"]
    # Warm workers, never one-shot; a store of each run's own.
    runs = [label for label in fake.order if label.endswith(("W1-1", "W1-2", "multiwindow", "archive", "killed"))]
    assert all("K6VSR_WARM_WORKERS" not in fake.calls[label][1] for label in runs)
    assert len({fake.calls[label][1]["K6VSR_STORE"] for label in runs}) == len(runs)
    # The kill: the worker that did not write the first denoise item (pids 102 and 103 for the two-GPU set).
    assert fake.calls["all-gpus-kill"][0] == ["kill", "-s", "KILL", "103"]

    rows = {row["run"]: row for row in check.rows}
    assert rows["one-gpu-workers-status"]["workers"] == [{"pid": 101, "gpu": "0"}]
    assert [w["gpu"] for w in rows["all-gpus-workers-status"]["workers"]] == ["0", "1"]
    killed = rows["all-gpus-W1-killed"]
    assert killed["kill"]["pid"] == 103 and killed["kill"]["writer"] == 102 and killed["kill"]["rc"] == 0
    assert killed["workers_after"] == [102, 104]  # the nanny's fresh worker in the killed one's place
    assert rows["one-gpu-multiwindow"]["windows"] == 3 and rows["all-gpus-multiwindow"]["s_per_window_gpu"] == 23.3
    assert rows["all-gpus-archive"]["clips_per_hour"] == 120.0 and rows["one-gpu-archive"]["clips_per_hour"] == 60.0

    verdicts = {v["target"]: v for v in check.verdicts()}
    w1 = verdicts["W1 on all GPUs, second run <= 0.55x one GPU's"]
    assert w1["pass"] is True and w1["measured"] == "32.0 s / 60.0 s = 0.533x"
    assert verdicts["W1 on all GPUs: the md5 of one GPU's"]["pass"] is True
    window = verdicts["multi-window on all GPUs: s/window <= 0.55x one GPU's"]
    assert window["pass"] is True and window["measured"].startswith("GPU stream 23.3 s a window / 47.3 s = 0.493x")
    archive = verdicts["archive on all GPUs: clips/h >= 1.9x one GPU's"]
    assert archive["pass"] is True and archive["measured"].endswith("= 2.0x")
    kill = verdicts["a worker SIGKILLed mid-tile: the run completes with one GPU's md5"]
    assert kill["pass"] is True and kill["measured"].startswith("pid 103 killed")
    assert verdicts["all-gpus-W1-killed completes"]["pass"] is True
    assert "W1: one md5 for every process" not in verdicts  # the sets' md5s are judged by their own verdicts
    table = (check.out / "device-check.md").read_text()
    assert "| all-gpus-W1-killed | W1 |" in table and "FAIL" not in table


def _two_gpu_rows(**changes: dict) -> list[dict]:
    """The rows of a passing call; `changes` updates a run's row."""
    rows = {
        "one-gpu-W1-2": {"wall_s": 60.0, "md5": "a"},
        "all-gpus-W1-2": {"wall_s": 30.0, "md5": "a"},
        "one-gpu-multiwindow": {"windows": 3, "s_per_window_gpu": 48.0, "s_per_window_wall": 60.0},
        "all-gpus-multiwindow": {"windows": 3, "s_per_window_gpu": 24.0, "s_per_window_wall": 34.0},
        "one-gpu-archive": {"clips": 4, "clips_done": 4, "clips_per_hour": 60.0, "wall_s": 240.0},
        "all-gpus-archive": {"clips": 4, "clips_done": 4, "clips_per_hour": 120.0, "wall_s": 120.0},
        two_gpus.KILLED: {"md5": "a", "kill": {"pid": 2, "rc": 0, "after_s": 9.0}},
    }
    for name, change in changes.items():
        rows[name.replace("_", "-")] = {**rows[name.replace("_", "-")], **change}
    return [{"run": name, "rc": 0, "group": two_gpus.GROUP, **row} for name, row in rows.items()]


@pytest.mark.parametrize(
    ("changes", "target"),
    [
        ({"all_gpus_W1_2": {"wall_s": 34.0}}, "W1 on all GPUs, second run <= 0.55x one GPU's"),  # 0.567x
        ({"all_gpus_W1_2": {"md5": "b"}}, "W1 on all GPUs: the md5 of one GPU's"),
        ({"all_gpus_multiwindow": {"s_per_window_gpu": 27.0}}, "multi-window on all GPUs: s/window <= 0.55x one GPU's"),
        ({"all_gpus_multiwindow": {"windows": 2}}, "multi-window on all GPUs: s/window <= 0.55x one GPU's"),
        ({"all_gpus_archive": {"clips_per_hour": 110.0}}, "archive on all GPUs: clips/h >= 1.9x one GPU's"),  # 1.83x
        ({"all_gpus_archive": {"clips_done": 3}}, "archive on all GPUs: clips/h >= 1.9x one GPU's"),
        ({"all_gpus_W1_killed": {"md5": "b"}}, "a worker SIGKILLed mid-tile: the run completes with one GPU's md5"),
        ({"all_gpus_W1_killed": {"kill": {}}}, "a worker SIGKILLed mid-tile: the run completes with one GPU's md5"),
    ],
)
def test_each_two_gpu_verdict_fails_on_its_own(changes: dict, target: str) -> None:
    passing = {v["target"]: v for v in two_gpus.verdicts(_two_gpu_rows(), device_check.TARGETS)}
    assert len(passing) == 5 and all(v["pass"] is True for v in passing.values())
    found = {v["target"]: v for v in two_gpus.verdicts(_two_gpu_rows(**changes), device_check.TARGETS)}
    assert found[target]["pass"] is False
    assert all(v["pass"] is True for name, v in found.items() if name != target)


def test_with_fewer_than_two_gpus_one_row_says_so_and_nothing_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check = _gpu_check(tmp_path, monkeypatch, ["0"])
    fake = FakeWorkers(tmp_path, check, {})
    monkeypatch.setattr(check, "command", fake)
    two_gpus.run_two_gpus(check, list(two_gpus.PARTS), clips=4)
    assert fake.order == []
    assert check.rows == [{"run": "two-gpus", "group": "two-gpus", "wall_s": 0.0, "note": mock.ANY}]
    assert check.rows[0]["note"].startswith("1 GPU visible (0): the two-GPU runs need at least 2")
    verdicts = two_gpus.verdicts(check.rows, device_check.TARGETS)
    assert len(verdicts) == 5 and all(v["pass"] is None and v["measured"] is None for v in verdicts)
    assert "| W1 on all GPUs, second run <= 0.55x one GPU's | no one-gpu-W1-2, all-gpus-W1-2 | not measured |" in (
        check.render()
    )


def test_two_gpu_parts_that_would_pass_the_deadline_are_left_out_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept, left_out = two_gpus.fitting(["w1", "kill"], 4, 560)
    assert kept == ["w1", "kill"] and not left_out  # the docstring's first call
    assert two_gpus.fitting(["multiwindow"], 4, 560) == (["multiwindow"], [])
    assert two_gpus.fitting(["archive"], 4, 560) == (["archive"], [])
    assert two_gpus.fitting(["archive"], 8, 560) == ([], ["archive"])  # the issue's 8 clips: more than a call
    assert two_gpus.fitting(list(two_gpus.PARTS), 4, 560) == (["w1"], ["multiwindow", "archive", "kill"])
    check = _gpu_check(tmp_path, monkeypatch, ["0", "1"])
    check.deadline = time.monotonic() + 400
    fake = FakeWorkers(tmp_path, check, TWO_GPU_WALLS)
    monkeypatch.setattr(check, "command", fake)
    two_gpus.run_two_gpus(check, ["w1", "archive"], clips=4)
    assert check.rows[0]["run"] == "two-gpus-left-out" and check.rows[0]["note"].endswith(": w1, archive")
    assert fake.order == []


def test_the_two_gpu_parts_are_checked_before_anything_runs() -> None:
    assert two_gpus.parse_parts("kill, w1") == ["w1", "kill"]  # always in the sets' order
    with pytest.raises(SystemExit):
        device_check.main(["--runs", "two-gpus", "--two-gpu-parts", "w1,windows"])


def test_kill_alone_runs_w1_once_on_one_gpu_for_its_md5_and_cpu_workers_stand_for_gpus_with_tiny(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check = _gpu_check(tmp_path, monkeypatch, ["0", "1"])
    fake = FakeWorkers(tmp_path, check, TWO_GPU_WALLS)
    monkeypatch.setattr(check, "command", fake)
    two_gpus.run_two_gpus(check, ["kill"], clips=4)
    runs = [label for label in fake.order if "W1" in label]
    assert runs == ["one-gpu-W1-1", "all-gpus-W1-killed"]
    kill = {v["target"]: v for v in check.verdicts()}[
        "a worker SIGKILLed mid-tile: the run completes with one GPU's md5"
    ]
    assert kill["pass"] is True
    one, every = two_gpus.gpu_sets([], tiny=True)
    assert (one.start_args, every.start_args) == (("-n", "1"), ("-n", "2")) and one.workers == 1 and every.workers == 2
    assert one.env == every.env == {"CUDA_VISIBLE_DEVICES": ""}  # no GPU for any command: the device is the CPU


def test_a_set_without_one_worker_per_gpu_runs_nothing_on_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers that did not start, or not one per GPU, would measure something else: the set's runs are not run."""
    check = _gpu_check(tmp_path, monkeypatch, ["0", "1"])
    fake = FakeWorkers(tmp_path, check, TWO_GPU_WALLS)
    started = fake.__call__

    def start_one(label: str, argv: list[str], env: dict[str, str] | None = None) -> dict:
        result = started(label, argv, env)
        if label == "all-gpus-workers-start":
            fake.workers = fake.workers[:1]  # one GPU's worker never came up
        return result

    monkeypatch.setattr(check, "command", start_one)
    two_gpus.run_two_gpus(check, ["w1"], clips=4)
    assert [label for label in fake.order if label.startswith("all-gpus")] == [
        "all-gpus-workers-start",
        "all-gpus-workers-status",
        "all-gpus-workers-stop",
    ]
    rows = {row["run"]: row for row in check.rows}
    assert rows["all-gpus-workers"]["rc"] == 1 and rows["all-gpus-workers"]["note"].startswith(
        "expected 2 warm workers, found 1 (pid 102 GPU 0)"
    )
    w1 = {v["target"]: v for v in check.verdicts()}["W1 on all GPUs, second run <= 0.55x one GPU's"]
    assert w1["pass"] is None and w1["missing"] == ["all-gpus-W1-2"]


def test_nvml_peaks_are_per_gpu_and_the_largest_card_is_the_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine of several GPUs each card's peak is kept (a two-GPU run's second card was not seen before); the
    table's figure is the largest card's, what a per-card budget is judged by."""
    import types

    used = {0: [1, 5, 2], 1: [3, 9, 4]}  # GiB each sample, per GPU
    samples = {index: iter(values) for index, values in used.items()}
    done = threading.Event()

    def memory_info(index: int) -> types.SimpleNamespace:
        value = next(samples[index], None)
        if value is None:
            done.set()
            value = used[index][-1]
        return types.SimpleNamespace(used=value * 2**30)

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetMemoryInfo=memory_info,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with device_check.NvmlPeak() as nvml:
        assert done.wait(10)
    assert nvml.per_gpu == [5.0, 9.0] and nvml.gib == 9.0
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML: no figure
    with device_check.NvmlPeak() as none:
        pass
    assert none.gib is None and none.per_gpu == []


def test_an_earlier_calls_in_memory_rows_are_this_calls_reference(tmp_path: Path) -> None:
    """`--reuse-rows`: a second call on the same machine takes the first one's in-memory rows (and nothing else of
    it) instead of running the runner again, and judges its own runs against them."""
    (tmp_path / "first").mkdir(), (tmp_path / "second").mkdir()
    first = _check(tmp_path / "first")
    first.add_row({"run": "inmemory-W1-2", "workload": "W1", "wall_s": 50.0, "rc": 0, "md5": SAME, "gpu_work_s": 46})
    first.add_row({"run": "workers-W1-1", "workload": "W1", "wall_s": 51.0, "rc": 0, "md5": SAME})
    second = _check(tmp_path / "second")
    second.reuse(first.out / "device-check.json")
    assert [row["run"] for row in second.rows] == ["inmemory-W1-2"]
    assert "from the earlier call" in second.rows[0]["note"]
    second.add_row({"run": "workers-W1-2", "workload": "W1", "wall_s": 52.0, "rc": 0, "md5": SAME})
    verdicts = {v["target"]: v for v in second.verdicts()}
    assert verdicts["workers-W1-2 <= 1.05x in-memory W1 hot"]["pass"] is True


# ------------------------------------------------------------------------------------------------ preview estimate


def _preview_summary(seconds_left: float, output_bytes: int, peak_store_bytes: int) -> str:
    """What `k6vsr preview --json` prints, from the flow's own models."""
    from flows.preview import PreviewSummary
    from storage.estimate import RunEstimate, StageRates

    rates = StageRates(
        ingest_s=2.0, model_s_per_frame=0.4, segment_s_per_frame=0.05, encoded_bytes_per_frame=9e3, windows_measured=1
    )
    estimate = RunEstimate(
        seconds=seconds_left + 50.0,
        seconds_left=seconds_left,
        output_bytes=output_bytes,
        peak_store_bytes=peak_store_bytes,
        windows_measured=1,
    )
    summary = PreviewSummary(
        source="clip.mp4",
        run_key="key",
        windows=[1],
        frames=[(105, 226)],
        side_by_side="clip_preview.mp4",
        contact_sheet="clip_preview.png",
        rates=rates,
        estimate=estimate,
    )
    return json.dumps(summary.model_dump(mode="json"), indent=2)


def _fake_preview_commands(
    monkeypatch: pytest.MonkeyPatch, check: device_check.Check, walls: dict[str, float], summary: str, rc: int = 0
) -> dict[str, tuple[list[str], dict[str, str]]]:
    """`check.command` for the preview run: the preview prints `summary` and leaves a window in the store; the run
    writes more into the store for a while, deletes it, and writes its output."""
    calls: dict[str, tuple[list[str], dict[str, str]]] = {}

    def command(label: str, argv: list[str], env: dict[str, str] | None = None) -> dict:
        env = env or check.env
        calls[label] = (argv, env)
        store = Path(env["K6VSR_STORE"])
        stdout = ""
        if argv[3] == "preview":
            (store / "runs" / "key").mkdir(parents=True)
            (store / "runs" / "key" / "window-1").write_bytes(b"w" * 1000)
            line = {"stage": "denoise", "item": "1-0", "start": time.time(), "end": time.time()}
            (store / "runs" / "key" / "timeline.jsonl").write_text(json.dumps(line) + "\n")
            stdout = "a line before the summary {not JSON}\n" + summary + "\n"
        elif argv[3] == "upscale" and rc == 0:
            assert (store / "runs" / "key" / "window-1").exists()  # the preview's window is there to reuse
            (store / "runs" / "key" / "window-0").write_bytes(b"w" * 3000)
            line = {"stage": "denoise", "item": "0-0", "start": time.time(), "end": time.time() + 1}
            with open(store / "runs" / "key" / "timeline.jsonl", "a") as timeline:  # one run key, one timeline
                timeline.write(json.dumps(line) + "\n")
            time.sleep(0.3)  # the store's peak is sampled while the run lasts
            (store / "runs" / "key" / "window-0").unlink()
            out_dir = Path(argv[argv.index("-o") + 1])
            out_dir.mkdir(parents=True)
            (out_dir / "clip_sr2x.mp4").write_bytes(b"v" * 500)
        wall = walls[label]
        return {"label": label, "wall_s": wall, "rc": rc if argv[3] == "upscale" else 0, "stdout": stdout, "stderr": ""}

    monkeypatch.setattr(check, "command", command)
    return calls


def test_the_preview_run_previews_then_runs_on_its_store_and_judges_the_estimate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The preview and the whole run with their commands faked (the real ones are the device's): the preview is the
    README command's as `k6vsr preview --windows 1 --json`, the run is the README's on the same store, and the row
    sets the preview's estimate against what the run took."""
    from bench import preview_check

    check = _check(tmp_path)
    monkeypatch.setattr(check, "clip", lambda workload: tmp_path / f"{workload}.mp4")
    monkeypatch.setattr(preview_check, "STORE_SAMPLE_S", 0.02)
    walls = {preview_check.PREVIEW: 90.0, preview_check.RUN: 200.0}
    calls = _fake_preview_commands(monkeypatch, check, walls, _preview_summary(220.0, 450, 8000))
    preview_check.run_preview(check)

    (preview, preview_env), (run, run_env) = calls[preview_check.PREVIEW], calls[preview_check.RUN]
    upscale = device_check.as_run(device_check.readme_gpu_command(), tmp_path / "W1-long.mp4", Path("/o"))
    assert preview[3] == "preview" and preview[-3:] == ["--windows", "1", "--json"]
    assert preview[4] == run[4] == str(tmp_path / "W1-long.mp4")  # the multi-window run's clip
    assert preview[5:-3] == [w if w != "/o/" else preview[6] for w in upscale[5:]]  # the README's flags
    assert run[3] == "upscale" and run[5:] == [w if w != "/o/" else run[6] for w in upscale[5:]]
    assert preview[6] != run[6]  # the side-by-side is not taken for the run's output
    assert preview_env["K6VSR_STORE"] == run_env["K6VSR_STORE"] == str(check.work / f"store-{preview_check.PREVIEW}")
    assert preview_env["K6VSR_WARM_WORKERS"] == run_env["K6VSR_WARM_WORKERS"] == "off"

    rows = {row["run"]: row for row in check.rows}
    assert (
        "stdout" not in rows[preview_check.PREVIEW] and rows[preview_check.PREVIEW]["estimate"]["seconds_left"] == 220
    )
    done = rows[preview_check.RUN]
    assert rows[preview_check.PREVIEW]["stages"]["denoise"][2] == done["stages"]["denoise"][2] == 1  # each its own
    assert done["actual"]["seconds"] == 200.0 and done["actual"]["output_bytes"] == 500
    assert done["actual"]["peak_store_bytes"] >= 4000  # the preview's window and the run's, not the end's 1000
    assert done["estimate_vs_run"]["seconds"] == 1.1 and done["estimate_vs_run"]["output_bytes"] == 0.9
    verdicts = {v["target"]: v for v in check.verdicts()}
    assert verdicts["preview estimate within 15% of the run"] == {
        "target": "preview estimate within 15% of the run",
        "measured": "220.0 s / 200.0 s = 1.1x",
        "pass": True,
    }
    disk = verdicts["preview disk estimate / the run's (output, peak store)"]
    assert disk["pass"] is None and disk["measured"].startswith("output_bytes 0.9x, peak_store_bytes ")
    assert "| preview estimate within 15% of the run | 220.0 s / 200.0 s = 1.1x | pass |" in check.render()


@pytest.mark.parametrize(
    ("seconds_left", "run_rc", "expected"),
    [(230.0, 0, True), (170.0, 0, True), (169.0, 0, False), (231.0, 0, False), (200.0, 1, None)],
)
def test_the_preview_verdict_is_within_15_per_cent_either_way_and_not_measured_without_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seconds_left: float, run_rc: int, expected: bool | None
) -> None:
    from bench import preview_check

    check = _check(tmp_path)
    monkeypatch.setattr(check, "clip", lambda workload: tmp_path / f"{workload}.mp4")
    walls = {preview_check.PREVIEW: 90.0, preview_check.RUN: 200.0}
    _fake_preview_commands(monkeypatch, check, walls, _preview_summary(seconds_left, 450, 8000), rc=run_rc)
    preview_check.run_preview(check)
    verdict = {v["target"]: v for v in check.verdicts()}["preview estimate within 15% of the run"]
    assert verdict["pass"] is expected
    if expected is None:
        assert verdict["missing"] == [f"{preview_check.RUN} (exit 1)"]


def test_a_preview_without_an_estimate_fails_its_row_and_runs_nothing_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench import preview_check

    check = _check(tmp_path)
    monkeypatch.setattr(check, "clip", lambda workload: tmp_path / f"{workload}.mp4")
    calls = _fake_preview_commands(monkeypatch, check, {preview_check.PREVIEW: 9.0}, "no summary")
    preview_check.run_preview(check)
    assert list(calls) == [preview_check.PREVIEW]
    row = check.rows[-1]
    assert row["rc"] == 1 and row["error"] == ["the preview printed no estimate"]
    verdicts = {v["target"]: v for v in check.verdicts()}
    assert verdicts["preview estimate within 15% of the run"]["pass"] is None
    assert verdicts[f"{preview_check.PREVIEW} completes"]["pass"] is False


def test_the_compile_notices_count_both_kinds_of_compile_line() -> None:
    """A shape's first compile and a compile of a shape run before are both counted (the second kind read 0)."""
    stderr = (
        "k6vsr: warning: compiling GPU kernels for the DiT at 1x31x32x48x129 (first run on this machine ...)\n"
        "k6vsr: the run's log ...\n"
        "k6vsr: warning: compiled 3 graphs of the KVAE decoder at 1x16x32x48 in 111 s although this machine ran this "
        "shape before: Inductor's cache (/c) did not hold them\n"
        "k6vsr: warning: compiled 1 graphs of the DiT at 1x31x32x48x129 in 61 s although this process ran this shape "
        "before: Inductor's cache (/c) did not hold them\n"
    )
    assert device_check.compile_notices(stderr) == 3
    assert device_check.compile_notices("k6vsr: done\n") == 0
