"""The device check measures the README's GPU command as the README writes it (the GPU run itself is on the device;
`bench/device_check.py --tiny` runs the same script on the CPU)."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import device_check, same_bytes, streaming

SAME = hashlib.md5(b"same").hexdigest()


def test_the_check_runs_the_readmes_gpu_command_with_only_the_clip_and_folder_substituted(tmp_path: Path) -> None:
    command = device_check.readme_gpu_command()
    assert command[0].endswith("k6vsr") and command[1] == "upscale" and "clip.mp4" in command
    argv = device_check.as_run(command, tmp_path / "w1.mp4", tmp_path / "out")
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
    command = device_check.readme_gpu_command()
    argv = device_check.as_archive(command, tmp_path / "in", tmp_path / "out")
    upscale = device_check.as_run(command, tmp_path / "in", tmp_path / "out")
    assert argv[3] == "archive" and argv[4] == str(tmp_path / "in") and argv[5:] == upscale[5:]
    with pytest.raises(SystemExit, match="not `k6vsr upscale"):
        device_check.as_archive(["k6vsr", "demo"], tmp_path / "in", tmp_path / "out")


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
    check.add_row({"run": "workers-W1-1", "workload": "W1", "wall_s": 60.0, "rc": 0, "md5": SAME})
    check.add_row({"run": "workers-W1-2", "workload": "W1", "wall_s": 52.0, "rc": 0, "md5": SAME})
    check.add_row({"run": "oneshot-W1-warm", "workload": "W1", "wall_s": 66.0, "rc": 0, "md5": SAME})

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
    assert len(found) == 6 and all(v["pass"] is None and v["measured"] is None for v in found)


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
    check.deadline = time.monotonic() + 350
    assert check.fits("archive-clip", 3) and not check.fits("archive-clip", 4)


def test_the_runner_child_reports_the_runners_stage_timings(
    tmp_path: Path, tiny_bundle_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The in-memory runner in the child, for real on a one-tile, one-frame clip and the tiny bundle on the CPU."""
    from k6vsr_core.sample import make_sample_clip

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
