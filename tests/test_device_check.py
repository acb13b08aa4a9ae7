"""The device check measures the README's GPU command as the README writes it (the GPU run itself is on the device;
`bench/device_check.py --tiny` runs the same script on the CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

from bench import device_check


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
