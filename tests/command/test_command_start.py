"""A command answers at once: `--help` and a refused flag in well under a second, because torch and diffusers are
imported only where tensors are computed, and no Prefect telemetry notice on a new user's first command."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import procs
import pytest

ROOT = Path(__file__).resolve().parents[2]
# The modules a command, the HTTP server's parent, a job launcher or a flow run imports before any tile is computed.
LIGHT_MODULES = [
    "entrypoints.cli",
    "entrypoints.console",
    "entrypoints.demo",
    "entrypoints.server.app",
    "entrypoints.server.job_records",
    "entrypoints.server.job_runner",
    "entrypoints.server.worker_slots",
    "entrypoints.server.child",
    "flows.artifacts",
    "flows.orchestrate",
    "runtime.prefect_server",
    "runtime.prefect_api",
    "runtime.flow_leases",
    "flows.run_log",
    "runtime.runners",
    "flows.stage_clock",
    "flows.upscale_archive",
    "flows.upscale_clip",
    "runtime.warm_workers",
    "k6vsr_core",
    "k6vsr_core.errors",
    "k6vsr_core.contract.params",
    "k6vsr_core.contract.plan",
    "k6vsr_core.contract.windows",
    "k6vsr_core.media.encoding",
    "k6vsr_core.media",
    "k6vsr_core.contract.latent",
    "k6vsr_core.contract.source",
    "k6vsr_core.model.memory",
    "k6vsr_core.contract.segments",
    "service.runs",
    "storage",
    "tasks.ingest",
    "tasks.stage_tasks",
]
# What `--help` and a refused flag must not import: the store, media and the model's code take a second or more.
NOT_FOR_HELP = (
    "zarr",
    "fsspec",
    "numcodecs",
    "av",
    "torch",
    "diffusers",
    "prefect",
    "distributed",
    "storage",
    "service",
)
# On an idle machine `--help` takes at most 0.5 s; the slack is for a busy two-core one.
HELP_LIMIT_S = 0.5
SLACK_S = 0.5


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


def test_no_torch_before_a_tensor_is_computed() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {LIGHT_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in ('torch', 'diffusers') if m in sys.modules))\n"
    )
    done = procs.run([sys.executable, "-c", code], env=_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["--help"], ["upscale", "--help"], ["upscale", "clip.mp4", "--scale", "3"]])
def test_help_and_a_refused_flag_import_no_store_media_or_model_code(argv: list[str]) -> None:
    code = (
        "import sys\n"
        "from entrypoints.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(sorted(m for m in {NOT_FOR_HELP!r} if m in sys.modules), file=sys.stderr)\n"
    )
    done = procs.run([sys.executable, "-c", code], env=_env(), cwd=ROOT)
    assert done.stderr.strip().splitlines()[-1] == "[]", done.stderr[-3000:]


@pytest.mark.parametrize(("device", "code"), [("cpu", 0), ("cuda:99", 2)])
def test_the_servers_own_process_imports_no_torch(device: str, code: int, tmp_path: Path) -> None:
    """`k6vsr serve` up to the point where it would listen (the server itself replaced), a device it must check
    included: torch is for its job processes, never for the process that serves HTTP."""
    script = (
        "import atexit, sys\n"
        "from entrypoints import cli\n"
        "from entrypoints.server import app as http_app\n"
        "heavy = ('torch', 'diffusers')\n"
        "atexit.register(lambda: print(sorted(m for m in heavy if m in sys.modules), file=sys.stderr))\n"
        "http_app.serve = lambda *args, **kwargs: print('would serve', file=sys.stderr)\n"
        f"sys.exit(cli.main(['serve', '--device', {device!r}, '--store', {str(tmp_path)!r}]))\n"
    )
    done = procs.run([sys.executable, "-c", script], env=_env(), cwd=ROOT)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code and lines[-1] == "[]", done.stderr[-3000:]
    assert ("would serve" in done.stderr) == (code == 0)
    if code:
        assert lines[-2].startswith("k6vsr: error: --device 'cuda:99'"), done.stderr[-3000:]


def _timed(*argv: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = procs.run([sys.executable, "-m", "entrypoints.cli", *argv], env=_env(), cwd=ROOT)
    return done, time.monotonic() - started


@pytest.mark.timed
def test_help_and_a_refused_flag_answer_within_a_second() -> None:
    _timed("--help")  # the first start reads the modules from disk; a user's second one finds them cached
    helped, help_s = _timed("--help")
    assert helped.returncode == 0 and "upscale" in helped.stdout
    refused, refused_s = _timed("upscale", "clip.mp4", "--scale", "3")
    assert refused.returncode == 2 and "scale" in refused.stderr and "Traceback" not in refused.stderr
    assert refused.stderr.count("\n") == 1, refused.stderr
    print(f"--help {help_s:.2f} s, a refused --scale {refused_s:.2f} s")
    assert help_s < HELP_LIMIT_S + SLACK_S and refused_s < HELP_LIMIT_S + SLACK_S


def test_no_telemetry_notice_on_a_new_users_first_command(tmp_path: Path) -> None:
    """Prefect shows its notice once, on a terminal, to a new PREFECT_HOME: the command runs on a pseudo-terminal."""
    ci_markers = ("CI", "GITHUB_ACTIONS", "GITLAB_CI", "JENKINS_URL", "BUILDKITE", "CI_NAME", "DO_NOT_TRACK")
    env = {key: value for key, value in _env().items() if key not in ci_markers and key != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), K6VSR_SERVER_HOME=str(tmp_path / "server"))
    main, child = pty.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "entrypoints.cli", "server", "status"],
            stdin=subprocess.DEVNULL,
            stdout=child,
            stderr=child,
            env=env,
            cwd=ROOT,
        )
        os.close(child)
        output = b""
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:  # the terminal's other end closed: the command ended
                break
            if not chunk:
                break
            output += chunk
        assert process.wait(timeout=120) == 0, output.decode(errors="replace")
    finally:
        os.close(main)
    text = output.decode(errors="replace")
    assert "local Prefect server not running" in text
    assert "usage data" not in text and "DO_NOT_TRACK" not in text, text


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path: Path) -> None:
    """`k6vsr workers status | head -1`: the pipe's reader is gone before the command writes its lines."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "entrypoints.cli", "gc", "--dry-run", "--store", str(tmp_path)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            cwd=ROOT,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 1 and done.stderr == "", done.stderr
