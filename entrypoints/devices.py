"""Whether this machine can use a `--device`: refused before any work, in one line, instead of after ingest inside a
stage task. `check_device` asks torch; `check_device_apart` asks it in a child process, for a parent that must not
import torch (`k6vsr serve`: its job processes load the model, the server itself never does).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from k6vsr_core.errors import UserFacingError

REPO_ROOT = Path(__file__).resolve().parents[1]
REFUSED = 2  # the child's exit code for a device this machine cannot use; its stdout says why


def check_device(device: str) -> None:
    """Raise a `UserFacingError` naming the cause if `device` (cpu, cuda, cuda:N or auto) cannot be used here."""
    if device in ("auto", "cpu"):
        return  # nothing to ask torch: auto takes what there is
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise UserFacingError(f"--device {device!r} is not a device; use cpu, cuda, cuda:N or auto") from None
    if parsed.type == "cpu":
        return
    if parsed.type != "cuda":
        raise UserFacingError(f"--device {device!r} is not supported; use cpu, cuda, cuda:N or auto")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise UserFacingError(f"--device {device!r}: no CUDA GPU is available here; use cpu or auto")
    if parsed.index is not None and parsed.index >= count:
        raise UserFacingError(f"--device {device!r}: this machine has {count} CUDA GPU(s) (cuda:0 to cuda:{count - 1})")


def check_device_apart(device: str) -> None:
    """`check_device` in a child process: this one imports no torch."""
    if device in ("auto", "cpu"):
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "entrypoints.devices", device], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode == REFUSED:
        raise UserFacingError(done.stdout.strip())
    if done.returncode != 0:
        raise RuntimeError(f"the device check of {device!r} failed: {done.stderr.strip()[-2000:]}")


if __name__ == "__main__":
    try:
        check_device(sys.argv[1])
    except UserFacingError as err:
        print(err)
        sys.exit(REFUSED)
