"""A newcomer's first run, on a pseudo-terminal as a person sees it: each slow step said as it starts (Prefect,
the local server with the UI's address, the model), then a bar that moves every second with the time elapsed and
left, then `k6vsr server status` with the same address."""

from __future__ import annotations

import base64
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

ROOT = Path(__file__).resolve().parents[2]


def _on_a_terminal(
    argv: list[str], env: dict[str, str], timeout_s: float = 480, until: str | None = None, exit_code: int = 0
) -> list[tuple[float, str]]:
    """Run `argv` on a 160x40 pseudo-terminal; what it wrote, as (seconds since start, screen line) pairs: each
    carriage return or newline starts a line, as a redrawn bar does. `until`: once a line matches it, the command
    is sent SIGTERM (a server runs until stopped), and it must exit with `exit_code`."""
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
            if until is not None and any(re.search(until, line) for _, line in lines):
                until = None
                process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == exit_code, "\n".join(line for _, line in lines[-40:])
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


def _damaged_clip(path: Path) -> Path:
    """Nine all-intra frames with the index at the front, the file cut where its sixth frame begins: five frames
    decode, the rest are lost, and reading it warns so."""
    import av
    import numpy as np

    whole = path.with_name("whole.mp4")
    with av.open(str(whole), "w", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt, stream.options = 64, 64, "yuv420p", {"g": "1"}
        for index in range(9):
            image = np.full((64, 64, 3), 20 * index, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())
    with av.open(str(whole)) as container:
        starts = sorted(packet.pos for packet in container.demux(video=0) if packet.pos is not None)
    path.write_bytes(whole.read_bytes()[: starts[5]])
    whole.unlink()
    return path


@pytest.mark.slow
def test_an_archive_s_warnings_stand_above_its_bars_and_its_skipped_files_are_named(
    prefect_server: str, tiny_bundle_path: Path, tmp_path: Path
) -> None:
    """A damaged file's warning is a line of its own above the bars, never written into a bar's line; the summary
    names each skipped file with its reason, as it names each failed one."""
    from k6vsr_core.media.sample import make_sample_clip

    folder = tmp_path / "in"
    folder.mkdir()
    make_sample_clip(folder / "a.mp4", width=64, height=64, num_frames=1)
    _damaged_clip(folder / "cut.mp4")
    (folder / "broken.mp4").write_bytes(bytes(range(256)) * 16)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    argv = [sys.executable, "-m", "entrypoints.cli", "archive", str(folder), "-o", str(tmp_path / "out")]
    argv += ["--model", str(tiny_bundle_path), "--device", "cpu", "--scale", "2", "--store", str(tmp_path / "store")]
    lines = [line for _, line in _on_a_terminal(argv, env)]
    screen = "\n".join(lines)

    warned = [i for i, line in enumerate(lines) if "k6vsr: warning:" in line]
    assert warned, screen
    for i in warned:
        assert lines[i].startswith("k6vsr: warning: "), lines[i]  # not after a bar's text on its line
    assert any("cut.mp4" in lines[i] and "could be decoded" in lines[i] for i in warned), screen
    # The bars go on below the warning.
    assert any(line.startswith(("clips: ", "planning the clips")) for line in lines[warned[0] + 1 :]), screen

    skipped = [line for line in lines if re.match(r"\s+skipped  broken\.mp4  \S", line)]
    assert len(skipped) == 1, screen
    assert str(folder) not in skipped[0]  # the reason, without the file's path the line already names
    assert lines[-2] == "2 done, 1 skipped", screen
    assert lines[-1] == f"manifest: {tmp_path / 'out' / 'k6vsr-archive-manifest.json'}", screen


@pytest.mark.slow
def test_serve_names_its_own_prefect_ui_and_how_to_log_in(tiny_bundle_path: Path, tmp_path: Path) -> None:
    """`k6vsr serve` reports to a secured Prefect server of its own: its lines name that UI's address, the command
    that shows this server (not the user's), and the file whose line its login page asks for."""
    import httpx

    store = tmp_path / "store"
    home = store / "prefect-server"
    env = {key: value for key, value in os.environ.items() if key not in ("PREFECT_API_URL", "K6VSR_SERVER_HOME")}
    env.update(
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_LOGGING_TO_API_ENABLED="false",
        K6VSR_STATE_HOME=str(tmp_path / "state"),  # the user's own server would be under it: never looked at
    )
    cli = [sys.executable, "-m", "entrypoints.cli"]
    argv = [*cli, "serve", "--port", str(_free_port()), "--store", str(store), "--model", str(tiny_bundle_path)]
    try:
        lines = _on_a_terminal([*argv, "--device", "cpu"], env, until=r"its login page asks", exit_code=143)
        said = [line for _, line in lines]
        ui_line = r"INFO:     the jobs' flow runs: Prefect UI at (http://127\.0\.0\.1:\d+) \(`(.+)` shows it again\)"
        [ui] = [m for line in said for m in [re.fullmatch(ui_line, line)] if m]
        login = r"INFO:     its login page asks for the auth string: paste the line of (\S+) \(owner-only\)"
        [auth_file] = [m.group(1) for line in said for m in [re.fullmatch(login, line)] if m]
        assert not any("k6vsr server status` shows it again" in line for line in said if line.startswith("k6vsr:"))
        assert ui.group(2) == f"K6VSR_SERVER_HOME={home.resolve()} k6vsr server status"

        # The command named shows this server's UI; the login page is asked for, and the file's line passes it.
        status_env = {**env, "K6VSR_SERVER_HOME": str(home.resolve())}
        status = subprocess.run([*cli, "server", "status"], env=status_env, cwd=ROOT, capture_output=True, text=True)
        assert f"  UI:  {ui.group(1)}" in status.stdout.splitlines(), status.stdout + status.stderr
        assert httpx.get(f"{ui.group(1)}/ui-settings", timeout=10).json()["auth"] == "BASIC"
        token = base64.b64encode(Path(auth_file).read_text().strip().encode()).decode()
        api = f"{ui.group(1)}/api/flow_runs/filter"
        assert httpx.post(api, json={}, timeout=10).status_code == 401
        assert httpx.post(api, json={}, headers={"Authorization": f"Basic {token}"}, timeout=10).status_code == 200
        assert Path(auth_file) == home.resolve() / "auth"
    finally:
        prefect_server.stop_server(home)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
