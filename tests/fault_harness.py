"""Fault injection for the reliability tests: the `k6vsr` command with one point of the pipeline made to die or fail.

    python tests/fault_harness.py [--state DIR] SPEC [SPEC ...] -- upscale clip.mp4 --model ... --json

A SPEC is `ACTION@POINT[:OPTION...]`:

    ACTION   kill     SIGKILL the process that reaches the point (no cleanup, no `finally`, like the OOM killer)
             raise    raise `InjectedFault` (a RuntimeError, so the stage tasks retry it as transient)
             nospace  raise `OSError(ENOSPC)`, as a full disk does
             stall    sleep `STALL_S` there, as a tile whose compute no signal stops (it runs in a task's thread)
    POINT    ingest   after the manifest is written, before the frame index (the ingest record)  RunStore.write_manifest
             encode   after the KVAE encode, before the latent is stored                      stages.encode_clip
             denoise  before a chunk of tiles is denoised                                     stages.denoise_chunk
             decode   before a tile is decoded                                                stages.decode_tile
             tile     after a decoded tile and its record are stored                          RunStore.put_tile("tiles")
             blend    after blending, before the window's frames are stored                   stages.blended
             segment  after a window's temporary MP4 is written, before it is committed       media.write_video
             mux      after the temporary output is joined, before it is committed           segments.join_segments
             publish  after half of the copy into the output folder is written                shutil.copyfile
    OPTION   nth=N    fire from the N-th call of this process on (default 1)
             times=N  fire at most N times over all processes (counted in the state folder)
             tile=I   denoise only: fire only for the chunk that holds tile I

The faults reach Dask worker processes too: the specs travel in `K6VSR_FAULTS` and `K6VSR_FAULT_STATE`, and the
harness writes a `sitecustomize.py` into the state folder and puts that folder on `PYTHONPATH`, so every Python
process started below it installs the same patches at start-up. `times=` counts with marker files there, so a fault
that must hit once is not replayed by the worker that replaces a killed one.

The tests also use it in-process: `with faults("raise@denoise:tile=1"): main([...])`.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_SPECS = "K6VSR_FAULTS"
ENV_STATE = "K6VSR_FAULT_STATE"
STALL_S = 600.0  # longer than any test waits
POINTS = ("ingest", "encode", "denoise", "decode", "tile", "blend", "segment", "mux", "publish")


class InjectedFault(RuntimeError):
    """The error a `raise@...` fault throws."""


@dataclass
class Fault:
    action: str
    point: str
    nth: int = 1
    times: int | None = None
    tile: int | None = None
    calls: int = field(default=0, compare=False)
    text: str = ""

    @classmethod
    def parse(cls, spec: str) -> Fault:
        head, *options = spec.strip().split(":")
        action, sep, point = head.partition("@")
        if not sep or action not in ("kill", "raise", "nospace", "stall") or point not in POINTS:
            raise ValueError(
                f"bad fault spec {spec!r}: want kill|raise|nospace|stall@{'|'.join(POINTS)}[:nth=N][:times=N][:tile=I]"
            )
        fault = cls(action=action, point=point, text=spec.strip())
        for option in options:
            key, _, value = option.partition("=")
            if key not in ("nth", "times", "tile") or not value.isdigit():
                raise ValueError(f"bad option {option!r} in fault spec {spec!r}")
            setattr(fault, key, int(value))
        return fault


def _state_dir() -> Path | None:
    state = os.environ.get(ENV_STATE)
    return Path(state) if state else None


def _claim(fault: Fault) -> bool:
    """Whether this call fires: the N-th call on, and (with `times`) while a marker slot is free in the state dir."""
    fault.calls += 1
    if fault.calls < fault.nth:
        return False
    if fault.times is None:
        return True
    state = _state_dir()
    if state is None:
        raise RuntimeError(f"fault {fault.text!r} uses times= but {ENV_STATE} is not set")
    safe = fault.text.replace("/", "_").replace(":", "_").replace("@", "_").replace("=", "_")
    for slot in range(fault.times):
        try:
            fd = os.open(state / f"fired-{safe}-{slot}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        return True
    return False


def _fire(fault: Fault, what: str) -> None:
    if fault.action == "kill":
        sys.stderr.write(f"fault_harness: SIGKILL in {what} (pid {os.getpid()})\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.action == "stall":
        sys.stderr.write(f"fault_harness: stalling {what} for {STALL_S:g} s (pid {os.getpid()})\n")
        sys.stderr.flush()
        time.sleep(STALL_S)
        return
    if fault.action == "nospace":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    raise InjectedFault(f"injected fault in {what}")


# ------------------------------------------------------------------------------------------------ patches


def _wrap_after(fault: Fault, original: Callable[..., Any], what: str) -> Callable[..., Any]:
    def patched(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if _claim(fault):
            _fire(fault, what)
        return result

    return patched


def _wrap_before(fault: Fault, original: Callable[..., Any], what: str) -> Callable[..., Any]:
    def patched(*args: Any, **kwargs: Any) -> Any:
        if _claim(fault):
            _fire(fault, what)
        return original(*args, **kwargs)

    return patched


def _patch(fault: Fault) -> Callable[[], None]:
    """Install one fault; returns its undo."""
    from k6vsr_core import media
    from k6vsr_core.contract import segments
    from k6vsr_core.model import stages
    from storage import run_store

    if fault.point == "ingest":
        owner, name = run_store.RunStore, "write_manifest"
        replacement = _wrap_after(fault, owner.write_manifest, "ingest (manifest written, frames not)")
    elif fault.point == "encode":
        owner, name = stages, "encode_clip"
        replacement = _wrap_after(fault, stages.encode_clip, "encode")
    elif fault.point == "denoise":
        owner, name = stages, "denoise_chunk"
        original_denoise = stages.denoise_chunk

        def replacement(bundle: Any, lr_tiles: Any, chunk: Any, plan: Any, *rest: Any, **kwargs: Any) -> Any:
            if (fault.tile is None or fault.tile in chunk.tiles) and _claim(fault):
                _fire(fault, f"denoise of tiles {list(chunk.tiles)}")
            return original_denoise(bundle, lr_tiles, chunk, plan, *rest, **kwargs)

    elif fault.point == "decode":
        owner, name = stages, "decode_tile"
        replacement = _wrap_before(fault, stages.decode_tile, "decode of a tile")
    elif fault.point == "tile":
        owner, name = run_store.RunStore, "put_tile"
        original_put = run_store.RunStore.put_tile

        def replacement(self: Any, array: str, key: tuple[int, ...], *rest: Any, **kwargs: Any) -> Any:
            result = original_put(self, array, key, *rest, **kwargs)
            if array == "tiles" and _claim(fault):
                _fire(fault, f"tiles (decoded tile {key} stored)")
            return result

    elif fault.point == "blend":
        owner, name = stages, "blended"  # the blend task adds its tiles as they come, then takes the canvas
        replacement = _wrap_after(fault, stages.blended, "blend")
    elif fault.point == "segment":
        owner, name = media, "write_video"
        replacement = _wrap_after(fault, media.write_video, "segment (temporary segment written)")
    elif fault.point == "mux":
        owner, name = segments, "join_segments"
        replacement = _wrap_after(fault, segments.join_segments, "mux (temporary output written)")
    else:  # publish
        owner, name = run_store.shutil, "copyfile"
        original_copy = shutil.copyfile

        def replacement(src: Any, dst: Any, *rest: Any, **kwargs: Any) -> Any:
            if not (Path(src).name == run_store.OUTPUT and str(dst).endswith(".partial")) or not _claim(fault):
                return original_copy(src, dst, *rest, **kwargs)
            data = Path(src).read_bytes()
            with open(dst, "wb") as handle:
                handle.write(data[: len(data) // 2])
            _fire(fault, "publish (half the output copied)")
            return dst

    saved = getattr(owner, name)
    setattr(owner, name, replacement)
    return lambda: setattr(owner, name, saved)


def install(specs: list[str]) -> Callable[[], None]:
    """Install every fault of `specs` in this process; returns one undo for all."""
    return _install([Fault.parse(spec) for spec in specs if spec.strip()])


def _install(parsed: list[Fault]) -> Callable[[], None]:
    undo = [_patch(fault) for fault in parsed]

    def restore() -> None:
        for step in reversed(undo):
            step()

    return restore


@contextmanager
def faults(*specs: str, state: str | Path | None = None) -> Iterator[list[Fault]]:
    """In-process faults for the duration of a `with` block; yields them (`fault.calls` counts the calls seen)."""
    saved = os.environ.get(ENV_STATE)
    if state is not None:
        os.environ[ENV_STATE] = str(state)
    parsed = [Fault.parse(spec) for spec in specs]
    restore = _install(parsed)
    try:
        yield parsed
    finally:
        restore()
        if state is not None:
            if saved is None:
                os.environ.pop(ENV_STATE, None)
            else:
                os.environ[ENV_STATE] = saved


def install_from_env() -> None:
    """The hook every child process runs at start-up (through the generated `sitecustomize`)."""
    specs = os.environ.get(ENV_SPECS, "")
    if specs and not getattr(install_from_env, "done", False):
        install_from_env.done = True  # type: ignore[attr-defined]
        install(specs.split(";"))


# ------------------------------------------------------------------------------------------------ test helpers

TEMP_MARKERS = (".partial", ".part.")


def leftovers(*folders: Path) -> list[Path]:
    """Temporary files (`*.partial`, `.part.*`) anywhere under `folders`."""
    found: list[Path] = []
    for folder in folders:
        if Path(folder).exists():
            found += [p for p in Path(folder).rglob("*") if any(m in p.name for m in TEMP_MARKERS)]
    return found


def command(*args: str, specs: tuple[str, ...] = (), state: Path | None = None) -> list[str]:
    """The argv of a `k6vsr` subprocess, through the harness when `specs` are given."""
    if not specs:
        return [sys.executable, "-m", "entrypoints.cli", *args]
    head = ["--state", str(state)] if state is not None else []
    return [sys.executable, str(Path(__file__).resolve()), *head, *specs, "--", *args]


def run_all(commands: list[list[str]], parallel: int = 3, timeout: float = 300.0) -> list[Any]:
    """Run commands as subprocesses, `parallel` at a time; returns their CompletedProcess-like results in order.

    A command past `timeout` is killed with its process group; its result has return code -9 and its threads'
    stacks as stderr."""
    import procs

    results: list[Any] = [None] * len(commands)
    pending = list(enumerate(commands))
    running: list[tuple[int, Any, float]] = []
    while pending or running:
        while pending and len(running) < parallel:
            index, argv = pending.pop(0)
            running.append((index, procs.start(argv), time.monotonic()))
        index, process, started = running.pop(0)
        results[index], _ = procs.finish(process, max(1.0, timeout - (time.monotonic() - started)))
    return results


_SITECUSTOMIZE = """\
# Written by tests/fault_harness.py: install the injected faults in every Python process of this run.
import sys
sys.path.insert(0, {folder!r})
try:
    import fault_harness
    fault_harness.install_from_env()
finally:
    sys.path.remove({folder!r})
"""


ENV_STATE_ROOT = "K6VSR_FAULTS_ROOT"


def child_environment(specs: list[str], state: Path) -> dict[str, str]:
    """The variables that make every Python process started with them install `specs` at start-up."""
    for spec in specs:
        Fault.parse(spec)  # fail fast on a typo
    state.mkdir(parents=True, exist_ok=True)
    (state / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(folder=str(Path(__file__).resolve().parent)))
    return {
        ENV_SPECS: ";".join(specs),
        ENV_STATE: str(state),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(state), os.environ.get("PYTHONPATH")])),
    }


def fired(state: Path) -> list[tuple[str, int]]:
    """The `times=` faults that fired, as (marker name, pid of the process that fired it)."""
    return [(p.name, int(p.read_text().split()[0])) for p in sorted(Path(state).glob("fired-*"))]


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    split = argv.index("--")
    head, command = argv[:split], argv[split + 1 :]
    state: str | None = None
    if head[:1] == ["--state"]:
        state, head = head[1], head[2:]
    # Under the test session's own temporary folder where the suite names one (pytest prunes it), so that no run of
    # the suite leaves a folder behind in the system's.
    root = os.environ.get(ENV_STATE_ROOT) or None
    state_dir = Path(state) if state else Path(tempfile.mkdtemp(prefix="k6vsr-faults-", dir=root))
    os.environ.update(child_environment(head, state_dir))
    install_from_env()

    from entrypoints.cli import main as k6vsr_main

    return k6vsr_main(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
