"""The device check measures the README's GPU command as the README writes it (the GPU run itself is on the device;
`bench/device_check.py --tiny` runs the same script on the CPU)."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import pytest

from bench import device_check, same_bytes

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
