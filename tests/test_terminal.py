"""A newcomer's first run, on a pseudo-terminal as a person sees it: each slow step said as it starts (Prefect,
the local server with the UI's address, the model), then a bar that moves every second with the time elapsed and
left, then `k6vsr server status` with the same address."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from runtime import prefect_server

ROOT = Path(__file__).resolve().parents[1]


def _on_a_terminal(argv: list[str], env: dict[str, str], timeout_s: float = 480) -> list[tuple[float, str]]:
    """Run `argv` on a 160x40 pseudo-terminal; what it wrote, as (seconds since start, screen line) pairs: each
    carriage return or newline starts a line, as a redrawn bar does."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a real terminal has a size
    started = time.monotonic()
    process = subprocess.Popen(argv, stdin=child, stdout=child, stderr=child, env=env, cwd=ROOT, start_new_session=True)
    os.close(child)
    lines: list[tuple[float, str]] = []
    pending = ""
    try:
        while time.monotonic() - started < timeout_s:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the terminal's other end closed: the command ended
                break
            if not chunk:
                break
            pending += chunk.decode(errors="replace")
            *done, pending = re.split(r"[\r\n]", pending)
            now = time.monotonic() - started
            lines += [(now, re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", line)) for line in done if line.strip()]
        assert process.wait(timeout=30) == 0, "\n".join(line for _, line in lines[-40:])
    finally:
        os.close(main)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return lines


@pytest.mark.slow
def test_a_first_run_says_what_it_does_and_its_bar_moves_every_second(
    tiny_bundle_path: Path, clip_1f: Path, tmp_path: Path
) -> None:
    home = tmp_path / "server"
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    env.update(
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        K6VSR_SERVER_HOME=str(home),
        K6VSR_SERVER_PORT="0",  # any free port: never the user's 4200
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_LOGGING_TO_API_ENABLED="false",
    )
    cli = [sys.executable, "-m", "entrypoints.cli"]
    argv = ["upscale", str(clip_1f), "-o", str(tmp_path / "out"), "--scale", "2", "--model", str(tiny_bundle_path)]
    try:
        lines = _on_a_terminal([*cli, *argv, "--store", str(tmp_path / "store")], env)
        status = subprocess.run([*cli, "server", "status"], env=env, cwd=ROOT, capture_output=True, text=True)
    finally:
        prefect_server.stop_server(home)
    said = [line for _, line in lines if line.startswith("k6vsr: ")]
    assert said[0] == "k6vsr: loading Prefect", said
    starting = next(i for i, line in enumerate(said) if line.startswith("k6vsr: starting the local Prefect server"))
    # The model loads beside the server's start (its tiles compute in this process), so its line may come between.
    pattern = r"k6vsr: Prefect UI: (http://127\.0\.0\.1:\d+) \(`k6vsr server status` shows it again\)"
    ui = next((m for line in said[starting + 1 :] for m in [re.fullmatch(pattern, line)] if m), None)
    assert ui, said
    assert any(line.startswith("k6vsr: loading the model ") for line in said), said
    assert f"  UI:  {ui.group(1)}" in status.stdout.splitlines(), status.stdout

    # The bar: redrawn with the elapsed time every second, a time left once the run has timed its model stages.
    bars = [(at, line) for at, line in lines if re.search(r"\| \d\d:\d\d elapsed, (\?|\d\d:\d\d) left$", line)]
    assert bars, "\n".join(line for _, line in lines)
    elapsed = [
        int(m.group(1)) * 60 + int(m.group(2)) for _, line in bars for m in [re.search(r"(\d\d):(\d\d) elaps", line)]
    ]
    # Nearly every second of the bar's life shows (a busy machine may hold its thread back for a moment); a bar
    # redrawn only as tiles finish would show a handful.
    assert max(elapsed) >= 5 and len(set(elapsed)) >= 0.75 * (max(elapsed) - min(elapsed) + 1), elapsed
    assert any(re.search(r", \d\d:\d\d left$", line) for _, line in bars), [line for _, line in bars]
    summary = next(line for _, line in lines if line.startswith("run "))
    assert re.search(r": 6 of 6 tiles computed, 0 reused, 12 DiT calls$", summary), summary
