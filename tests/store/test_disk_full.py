"""A full disk: the store and the output folder on a small tmpfs that fills while a tile is decoded.

The run fails with one line naming the disk, publishes nothing and takes nothing half-written for done; once the
space is freed the rerun finishes with the bytes of a run that never met a full disk. The disk is real (a tmpfs
mounted for the test): what fails is the kernel's ENOSPC at whichever write comes first, not an injected error.
"""

from __future__ import annotations

import errno
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fault_harness
import pytest

from entrypoints.cli import main
from k6vsr_core.media.sample import make_sample_clip
from storage import RunStore

pytestmark = pytest.mark.usefixtures("prefect_server")

NAME = "out.mp4"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True, text=True
        )
    except OSError as err:
        pytest.skip(f"cannot mount a tmpfs here: {err}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path) -> Path:
    """Write a file until the disk has no room left; returns it (deleting it frees the space)."""
    ballast = disk / "ballast"
    with open(ballast, "wb", buffering=0) as handle:
        for size in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    handle.write(b"\0" * size)
            except OSError as err:
                assert err.errno == errno.ENOSPC, err
    return ballast


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, dict[str, Any] | None, str]:
    capsys.readouterr()
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, (json.loads(captured.out) if rc == 0 else None), captured.err


def test_disk_full_mid_run_fails_clearly_publishes_nothing_and_resumes(
    small_disk: Path, tiny_bundle_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from k6vsr_core.model import stages

    clip = make_sample_clip(tmp_path / "clip.mp4", width=96, height=64, num_frames=1)

    def argv(store: Path, out: Path) -> list[str]:
        return [
            "upscale", str(clip), "--scale", "2", "--model", str(tiny_bundle_path), "--device", "cpu",
            "--store", str(store), "-o", str(out), "--output-file-name", NAME, "--json",
        ]  # fmt: skip

    rc, _, err = _run(argv(tmp_path / "clean-store", tmp_path / "clean-out"), capsys)
    assert rc == 0, err[-3000:]
    clean = (tmp_path / "clean-out" / NAME).read_bytes()

    store, out = small_disk / "store", small_disk / "out"
    original = stages.decode_tile
    ballast: list[Path] = []

    def decode_on_a_filling_disk(*args: Any, **kwargs: Any) -> Any:
        if not ballast:
            ballast.append(fill(small_disk))
        return original(*args, **kwargs)

    monkeypatch.setattr(stages, "decode_tile", decode_on_a_filling_disk)
    rc, _, err = _run(argv(store, out), capsys)
    assert ballast, err[-3000:]
    assert rc == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    (message,) = [line for line in err.splitlines() if line.startswith("k6vsr: error:")]
    assert f"No space left on device on the disk mounted at {small_disk} (" in message, message
    assert "free some space and rerun the same command to resume" in message
    assert not (out / NAME).exists() and fault_harness.leftovers(out) == []
    (run_dir,) = (store / "runs").iterdir()
    stored = RunStore(store, run_dir.name)
    # Nothing the full disk cut short is taken as done: every record's bytes, where still stored, are whole.
    assert stored.records.items("decode") == [] and not stored.output_done()

    ballast[0].unlink()
    monkeypatch.setattr(stages, "decode_tile", original)
    rc, summary, err = _run(argv(store, out), capsys)
    assert rc == 0, err[-3000:]
    assert (out / NAME).read_bytes() == clean
    assert summary["tiles_computed"] == summary["tiles_total"]
    assert fault_harness.leftovers(store, out) == []
