"""What `k6vsr plan` and `k6vsr gc` print for people: a readable table and sizes in MB or GB, never Python dicts or
raw byte counts; `--json` for machines; `gc --dry-run` deletes nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from entrypoints.cli import main
from entrypoints.console import size_text


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    return capsys.readouterr().out


def test_plan_prints_a_readable_table(clip_1f: Path, tiny_bundle_path: Path, tmp_path: Path, capsys) -> None:
    argv = ["plan", str(clip_1f), "--scale", "2", "--model", str(tiny_bundle_path), "--store", str(tmp_path)]
    text = _run(argv, capsys)
    lines = text.splitlines()
    labels = ["source", "fields", "timing", "output", "model", "tiles", "windows"]
    assert [line.split()[0] for line in lines[:7]] == labels
    assert lines[0].endswith(
        ": 128x96, 1 frame at 24 fps, colour unspecified/unspecified/unspecified/unspecified, 8-bit"
    ) and lines[3].startswith("output    256x192, 1 frame at")
    assert lines[1].startswith("fields    progressive") and lines[2] == "timing    constant frame rate"
    header = lines.index("            window  frames        computed as  overlap  segment")
    assert lines[header + 1].split() == ["0", "0", "1", "0", "0"]  # frame 0, computed as 1, no overlap, segment 0
    store = next(line for line in lines if line.startswith("store"))
    assert " MB " in store or " KB " in store
    assert "{" not in text and "[" not in text and "_bytes" not in text
    assert lines[-1].endswith("0 of 6 (window, tile) items done, 0 of 1 segment")

    machine = json.loads(_run([*argv, "--json"], capsys))
    assert machine["tiles_per_window"] == 6 and machine["store_estimate"]["peak_bytes"] > 0


def test_plan_needs_only_the_model_configs(clip_1f: Path, tiny_bundle_path: Path, tmp_path: Path, capsys) -> None:
    """A bundle folder of config files alone (no weights) plans as the whole bundle does; only the model's identity,
    and the run key made from it, differ, and the table says why."""
    configs = tmp_path / "configs-only"
    for config in tiny_bundle_path.rglob("*.json"):
        target = configs / config.relative_to(tiny_bundle_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(config, target)
    assert not list(configs.rglob("*.safetensors"))

    def plan(model: Path, *flags: str) -> str:
        argv = ["plan", str(clip_1f), "--scale", "2", "--model", str(model), "--store", str(tmp_path / "store")]
        return _run([*argv, *flags], capsys)

    full, light = json.loads(plan(tiny_bundle_path, "--json")), json.loads(plan(configs, "--json"))
    assert full["model_weights_present"] is True and light["model_weights_present"] is False
    assert light["model"] != full["model"] and light["run_key"] != full["run_key"]
    identity = {"model", "model_weights_present", "run_key"}
    assert {k: v for k, v in light.items() if k not in identity} == {k: v for k, v in full.items() if k not in identity}

    model_line = next(line for line in plan(configs).splitlines() if line.startswith("model"))
    assert model_line.endswith("(configs only: the run key changes once the weight files are in the folder)")
    assert "configs only" not in plan(tiny_bundle_path)


def test_gc_dry_run_says_what_it_would_reclaim_in_mb(tmp_path: Path, capsys) -> None:
    run = tmp_path / "store" / "runs" / "0123456789abcdef01234567"
    run.mkdir(parents=True)
    (run / "data.bin").write_bytes(b"\0" * 2_500_000)
    argv = ["gc", "--store", str(tmp_path / "store")]

    dry = _run([*argv, "--dry-run"], capsys)
    assert dry.splitlines()[0] == "would reclaim 2.5 MB from 1 run" and (run / "data.bin").is_file()
    assert dry.splitlines()[1] == f"  {run.name}: would be reclaimed, 2.5 MB"
    kept = _run([*argv, "--dry-run", "--keep-outputs"], capsys)
    assert "would be reclaimed" in kept and (run / "data.bin").is_file()
    assert json.loads(_run([*argv, "--dry-run", "--json"], capsys))["dry_run"] is True and run.is_dir()

    done = _run(argv, capsys)
    assert done.splitlines()[0] == "reclaimed 2.5 MB from 1 run" and not run.exists()
    assert done.splitlines()[1] == f"  {run.name}: reclaimed, 2.5 MB"


@pytest.mark.parametrize(
    ("size", "text"), [(512, "512 B"), (2_048, "2.0 KB"), (41_959_424, "42.0 MB"), (1_234_567_890, "1.23 GB")]
)
def test_sizes_read_as_people_read_them(size: int, text: str) -> None:
    assert size_text(size) == text
