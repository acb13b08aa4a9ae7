"""Ctrl-C and SIGTERM stop `k6vsr upscale` within 3 s, mid-denoise: one line, exit 130 or 143, no traceback, no
process left behind, and the flow run and every task run of it final (Cancelled or Completed) in Prefect, none left
"Running"."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import procs
import pytest

from entrypoints.stopping import MESSAGE
from k6vsr_core.media.sample import make_sample_clip

pytestmark = [pytest.mark.usefixtures("prefect_server", "interruptible"), pytest.mark.timed]

ROOT = Path(__file__).resolve().parents[2]
STOP_LIMIT_S = 3.0


@pytest.fixture(scope="module")
def slow_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20 chunks of tiles at x2 with the tiny bundle: the denoise stage lasts long enough to be interrupted."""
    return make_sample_clip(tmp_path_factory.mktemp("clips") / "slow.mp4", width=256, height=192, num_frames=9)


@pytest.fixture
def interruptible() -> Iterator[None]:
    """Ctrl-C reaches the command as at a terminal even when the suite itself runs in the background (`cmd &`),
    which starts it with SIGINT ignored: a child inherits an ignored signal, and Python then never raises
    KeyboardInterrupt. A handled SIGINT is reset to its default in the child, which Python turns into one."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _processes_with(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker.encode() in (proc / "environ").read_bytes().split(b"\0"):
                if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(proc.name))
        except OSError:
            continue
    return found


def _run_states(name: str) -> tuple[str, list[str]]:
    """The state of the one flow run called `name`, and those of its task runs."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter, TaskRunFilterFlowRunId

    with get_client(sync_client=True) as client:
        (run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
        tasks = client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[run.id])))
        return run.state.name, [task.state.name for task in tasks]


@pytest.mark.parametrize(
    ("signum", "code", "extra", "lanes"),
    [
        (signal.SIGINT, 130, (), "threads"),
        (signal.SIGTERM, 143, ("--workers", "2"), "threads"),
        (signal.SIGTERM, 143, (), "processes"),  # the split cluster a GPU machine's command starts for itself
    ],
    ids=["ctrl-c-threads", "sigterm-dask-workers", "sigterm-split-cluster"],
)
def test_an_interrupt_stops_the_run_at_once_and_leaves_the_truth(
    signum: int, code: int, extra: tuple[str, ...], lanes: str, slow_clip: Path, tiny_bundle_path: Path, tmp_path: Path
) -> None:
    clip = tmp_path / f"interrupted-{signal.Signals(signum).name}-{lanes}.mp4"  # its own flow run name
    shutil.copyfile(slow_clip, clip)
    store = tmp_path / "store"
    marker = f"K6VSR_TEST_STOP={uuid.uuid4()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), marker.split("=")[0]: marker.split("=")[1], "K6VSR_LANES": lanes}
    argv = [
        sys.executable, "-m", "entrypoints.cli", "upscale", str(clip), "--scale", "2", "--model",
        str(tiny_bundle_path), "--device", "cpu", "--store", str(store), "-o", str(tmp_path / "out"), *extra,
    ]  # fmt: skip
    process = procs.start(argv, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while not list(store.glob("runs/*/done/encode/*.json")):  # the denoise of window 0 has begun
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run did not reach its denoise stage"
            time.sleep(0.2)
        time.sleep(1.0)
        started = time.monotonic()
        process.send_signal(signum)
        done, hung = procs.finish(process, timeout=60)
        took = time.monotonic() - started
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert not hung, done.stderr[-3000:]
    assert done.returncode == code, done.stderr[-3000:]
    assert took < STOP_LIMIT_S, f"stopped in {took:.1f} s"
    assert "Traceback" not in done.stderr, done.stderr[-6000:]
    assert done.stderr.rstrip().splitlines()[-1] == f"k6vsr: {MESSAGE}", done.stderr[-3000:]
    assert not list((tmp_path / "out").glob("*.mp4")), "an output was written"

    # What outlives the command by a moment ends by itself: the helper that marks its runs once it is gone, and
    # Python's resource tracker, which frees what the Dask workers left.
    deadline = time.monotonic() + 30
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(marker) == [], "a process of the command outlived it"

    state, task_states = _run_states(f"upscale-{clip.name}")
    assert state == "Cancelled"
    assert task_states and all(s in ("Completed", "Cancelled") for s in task_states), task_states


def test_an_interrupt_a_library_wraps_in_its_own_error_is_still_an_interrupt() -> None:
    """A signal that lands while pydantic calls back into Python comes out as a serialization error: within a flow's
    body (`noting_signals`) it is still the interrupt it was, and reaches the registered handler."""
    import os
    import signal

    from pydantic import BaseModel, model_serializer
    from pydantic_core import PydanticSerializationError

    from runtime import interrupts

    class Interrupting(BaseModel):
        @model_serializer
        def _serialize(self) -> dict:
            os.kill(os.getpid(), signal.SIGTERM)
            return {}

    def raising(signum: int, frame: object) -> None:
        raise RuntimeError("what a library's signal handler raises")

    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, raising)
    interrupts.on_interrupt(seen.append)
    try:
        with interrupts.noting_signals():
            with pytest.raises(PydanticSerializationError) as caught:
                Interrupting().model_dump()
            interrupts.surfaced(caught.value)
            assert seen == [signal.SIGTERM]  # at once, not by the fallback a moment later
        assert interrupts.signal_of(RuntimeError("after the block")) is None  # the noted signal was the block's
    finally:
        interrupts.on_interrupt(None)
        signal.signal(signal.SIGTERM, previous)


def test_an_interrupt_lost_where_python_ignores_exceptions_still_reaches_the_handler() -> None:
    """Raised inside a garbage-collection callback, what a signal handler raises is printed and dropped: within a
    flow's body the registered handler has been called before, from the signal handler itself."""
    import gc
    import os
    import signal
    import threading

    from runtime import interrupts

    called = threading.Event()
    seen: list[int] = []

    def handler(signum: int) -> None:
        seen.append(signum)
        called.set()

    def raising(signum: int, frame: object) -> None:
        raise RuntimeError("what a library's signal handler raises")

    def interrupting_callback(phase: str, info: dict) -> None:
        if phase == "start" and not seen and not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

    fired: list[bool] = []
    previous = signal.signal(signal.SIGTERM, raising)
    interrupts.on_interrupt(handler)
    gc.callbacks.append(interrupting_callback)
    try:
        with interrupts.noting_signals():
            gc.collect()  # the interrupt is raised, and dropped, inside the callback
            assert called.is_set()  # already: not left to a timer or to the raised interrupt
    finally:
        gc.callbacks.remove(interrupting_callback)
        interrupts.on_interrupt(None)
        signal.signal(signal.SIGTERM, previous)
    assert seen == [signal.SIGTERM]
