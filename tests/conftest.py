"""Shared fixtures for the k6vsr_core tests: tiny random model bundles, written and loaded once per session.

The tiny bundles have the released layout and native config spelling but tile sizes (128,128), (128,256),
(256,128), so every model stage runs in well under a second on a CPU for 1-frame clips of 64-96 px.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from k6vsr_core.model.bundle import ModelBundle, load_bundle
from k6vsr_core.model.tiny_bundle import make_tiny_bundle

# The files that take longest, in that order, start first. The README's test command shares the files between two
# workers in collection order; a long file left for the end would keep one worker busy after the other has finished.
LONGEST_FILES = (
    "test_long_videos.py",
    "test_fleet_sim.py",
    "test_media_matrix.py",
    "test_object_store.py",
    "test_warm_workers.py",
    "test_output_controls.py",
    "test_same_bytes.py",
    "test_flow.py",
    "test_compile_cache.py",
    "test_faults.py",
    "test_concurrency_resources.py",
    "test_browser.py",
    "test_fast.py",
    "test_prefect_server.py",
    "test_server_postgres.py",
    "test_server.py",
    "test_server_limits.py",
    "test_server_bounds.py",
    "test_ui_artifacts.py",
    "test_latent_input.py",
    "test_bad_inputs.py",
    "test_memory.py",
    "test_chaos_http.py",
    "test_chaos.py",
    "test_server_stalls.py",
    "test_archive_media.py",
)


# Two test workers on two cores: a run's compute profile would give each of their processes (and the commands they
# start, which inherit this) a thread per core, and every parallel region of one would wait for a thread the other
# worker holds (a 3 s runner test took 40-110 s so). One thread each keeps both cores busy. The bytes do not depend
# on it: every test compares runs made under the same profile.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("K6VSR_CPU_THREADS", "1")


# What puts a test outside the fast tier: a Prefect server (each flow run costs seconds), a file among the longest.
HEAVY_FIXTURES = {"prefect_server"}


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the fast tier is marked here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    for item in items:
        heavy = HEAVY_FIXTURES & set(getattr(item, "fixturenames", ())) or item.path.name in rank
        if not heavy and not any(item.get_closest_marker(name) for name in ("slow", "timed")):
            item.add_marker(pytest.mark.fast)


@pytest.fixture(scope="session")
def tiny_bundle_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The distilled (PiFlow, 640-wide head) tiny bundle, written once. Tests must not modify it: copy it."""
    return make_tiny_bundle(tmp_path_factory.mktemp("bundles") / "tiny")


@pytest.fixture(scope="session")
def tiny_bundle(tiny_bundle_path: Path) -> ModelBundle:
    """The distilled tiny bundle, loaded once on the CPU (fp32)."""
    return load_bundle(str(tiny_bundle_path))


@pytest.fixture(scope="session")
def flow_bundle_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The non-distilled tiny bundle (flow-Euler scheduler, 64-wide head), written once."""
    return make_tiny_bundle(tmp_path_factory.mktemp("bundles") / "tiny-flow", distilled=False)


@pytest.fixture(scope="session")
def flow_bundle(flow_bundle_path: Path) -> ModelBundle:
    return load_bundle(str(flow_bundle_path))


# --------------------------------------------------------------------------------------------------- Prefect


@pytest.fixture
def plan_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every `make_plan` call from here on, wherever it is made (each module holds its own name for it)."""
    import k6vsr_core.contract.latent
    import k6vsr_core.contract.plan
    import k6vsr_core.contract.source

    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return k6vsr_core.contract.plan.make_plan(*args, **kwargs)

    for module in (k6vsr_core.contract.source, k6vsr_core.contract.latent):
        monkeypatch.setattr(module, "make_plan", counted)
    return calls


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory):
    """One real `prefect server start` for the session (for each worker), on loopback; its API URL is exported to
    every process.

    One server costs ~15 s once; a temporary server per process would cost that in every subprocess and Dask
    worker.
    """
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_UI_ENABLED": os.environ.get("PREFECT_UI_ENABLED", "true"),
    }
    env.pop("PREFECT_API_URL", None)
    log = (home / "server.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "runtime.sqlite_writes", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
        if process.poll() is not None:
            raise RuntimeError(f"prefect server exited: {(home / 'server.log').read_text()[-2000:]}")
    else:
        process.kill()
        raise RuntimeError("prefect server did not become healthy in 120 s")
    exported = {
        "PREFECT_API_URL": url,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # Run logs stay local: shipping them to the server makes every process wait for it at exit.
        "PREFECT_LOGGING_TO_API_ENABLED": "false",
        # The flow-run leases (runtime.prefect_server) of the tests' runs, kept out of the user's own state folder.
        "K6VSR_SERVER_HOME": str(home / "k6vsr-server"),
        # Runs never go to the user's warm workers: only to those a test starts under this folder.
        "K6VSR_WORKERS_HOME": str(home / "k6vsr-workers"),
    }
    saved = {key: os.environ.get(key) for key in exported}
    os.environ.update(exported)
    from prefect.settings import PREFECT_API_URL, PREFECT_LOGGING_TO_API_ENABLED, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: url, PREFECT_LOGGING_TO_API_ENABLED: False}):
        yield url
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()


@pytest.fixture(scope="session")
def clip_1f(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-frame 128x96 clip with audio: 6 tiles at x2 with the tiny bundle, each stage well under a second."""
    from k6vsr_core.media.sample import make_sample_clip

    return make_sample_clip(tmp_path_factory.mktemp("clips") / "one.mp4", width=128, height=96, num_frames=1)


@pytest.fixture(scope="session")
def reference(tiny_bundle: ModelBundle, clip_1f: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """`clip_1f` upscaled x2 by the in-memory runner with the tiny bundle: the bytes every way of running it gives
    (tests/flows/test_same_bytes.py)."""
    from k6vsr_core import upscale
    from k6vsr_core.contract.params import UpscaleParams

    out = tmp_path_factory.mktemp("reference") / "ref.mp4"
    upscale(clip_1f, out, tiny_bundle, UpscaleParams(scale=2))
    return out.read_bytes()


@pytest.fixture(scope="session", autouse=True)
def _fault_states_under_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The fault harness's state folders of commands given no `--state` (tests/fault_harness.py)."""
    from fault_harness import ENV_STATE_ROOT

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV_STATE_ROOT, str(tmp_path_factory.mktemp("fault-states")))
        yield


@pytest.fixture(scope="session", autouse=True)
def _state_under_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every state folder a test's command would keep in the user's home (the local Prefect server, the warm workers,
    the flow-run leases) under the session's temporary folder instead: a command run without the `prefect_server`
    fixture starts a server of its own there, never the user's, and it is stopped as the session ends."""
    from runtime import prefect_server

    home = tmp_path_factory.mktemp("state-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("K6VSR_STATE_HOME", str(home))
        # Run logs stay local, as with `prefect_server`: the server may be stopped before this process's last flush.
        patch.setenv("PREFECT_LOGGING_TO_API_ENABLED", "false")
        yield
    prefect_server.stop_server(home / "prefect-server")
