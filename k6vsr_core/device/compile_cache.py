"""The compile cache: where compiled kernels are kept, the one-line notice of a cold compile, and a portable file.

A cold compile of the DiT blocks and the KVAE decoder at W1's shapes takes about three minutes on an H200; with
Inductor's persistent caches (FX graph, AOT autograd, Triton kernels) in a per-user folder, a later process on the
same machine is compiled in about 20 s. Three things here make that visible and portable:

- `CompileWatch` tells, once per process and shape, that kernels are being compiled for a shape this machine has
  never run (a marker per shape in the cache folder), with the usual cost and the way to avoid it.
- `save_process_artifacts` keeps what this process compiled or loaded as PyTorch's own cache artefacts
  (`torch.compiler.save_cache_artifacts`), one file per process, newest kept.
- `export_cache(FILE)` packs those artefacts and the shape markers into one zip; `import_cache(FILE)` loads them
  (`torch.compiler.load_cache_artifacts`) into this machine's caches. `$K6VSR_COMPILE_ARTIFACTS` names such a file
  for every process that compiles (deployments, warm workers, the HTTP server): it is imported once, before the
  first compile. The artefacts only hit on the same torch, Triton, CUDA and GPU model: the file records them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import threading
import time
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from k6vsr_core import settings
from k6vsr_core.device.process_env import compile_cache_dir

ARTIFACTS_ENV = settings.env_name("compile_artifacts")
# Measured on an H200 (bench/RESULTS.md): DiT blocks and KVAE decoder at W1's shapes, empty cache, about 3 minutes;
# flex attention alone (`--no-compile`) a few seconds.
COMPILE_ESTIMATES = {"networks": "about 3 minutes on an H200", "flex attention": "a few seconds"}
KEEP_PROCESS_FILES = 16
ARCHIVE_MANIFEST = "k6vsr-compile-cache.json"

log = logging.getLogger("k6vsr.compile")


class CompileNotice(UserWarning):
    """Kernels are being compiled for a shape this machine has not run before (shown once per shape)."""


class CacheManifest(BaseModel):
    """What an exported cache file holds and where its artefacts can hit."""

    torch: str
    cuda: str | None
    triton: str | None
    device: str | None
    machine: str
    shapes: list[str]
    artifacts: list[str]
    created_at: float


# ---------------------------------------------------------------------------------------------------- folders


def enable_compile_cache(path: str | os.PathLike[str] | None = None) -> Path:
    """Point Inductor's persistent caches at `path` (default `compile_cache_dir()`), unless already set.

    Call before the first compile of the process: Inductor picks its cache folder when it first needs it, and
    anything that asks for it sooner sets `TORCHINDUCTOR_CACHE_DIR` to its own default, which then wins here (why
    the command sets it as it starts: `k6vsr_core.device.process_env`). An explicit `TORCHINDUCTOR_CACHE_DIR` wins.
    """
    root = Path(path) if path is not None else compile_cache_dir()
    inductor = Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor")))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    inductor.mkdir(parents=True, exist_ok=True)
    from torch._inductor import config as inductor_config

    inductor_config.fx_graph_cache = True
    if hasattr(inductor_config, "autograd_cache"):
        inductor_config.autograd_cache = True  # type: ignore[attr-defined]
    return inductor


def _stack() -> dict[str, str | None]:
    """What compiled kernels depend on: a marker or an artefact from another stack never hits."""
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version, "device": device}


# ---------------------------------------------------------------------------------------------------- cold-start notice


def shape_key(component: str, shape: tuple[int, ...], detail: str = "") -> str:
    stack = _stack()
    return f"{component} {'x'.join(map(str, shape))} {detail} | torch {stack['torch']} | {stack['device']}".strip()


def _marker(root: Path, key: str) -> Path:
    return root / "shapes" / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def _write_marker(root: Path, key: str) -> None:
    path = _marker(root, key)
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_suffix(f".{os.getpid()}.tmp")
    temp.write_text(json.dumps({"key": key, "at": time.time()}))
    os.replace(temp, path)


def known_shapes(root: Path | None = None) -> list[str]:
    folder = (root or compile_cache_dir()) / "shapes"
    keys = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            keys.append(json.loads(path.read_text())["key"])
        except (OSError, ValueError, KeyError):
            continue
    return keys


class CompileWatch:
    """Wraps each call of a compiled network: before the first call of a shape in this process, says whether the
    machine must compile it; after it, marks the shape compiled and keeps the process's cache artefacts."""

    def __init__(self, root: Path, watched: set[tuple[str, str | None]], estimate: str) -> None:
        self.root = root
        # (component, detail) pairs that compile; a detail of None stands for every detail of that component.
        self.watched = watched
        self.estimate = estimate
        self._lock = threading.Lock()
        # Each shape's first call in this process, set once it has ended. A call that came while another thread
        # compiled its shape compiled it a second time (Dynamo looks for a compiled graph before it waits for its
        # compile lock): the warm-up's DiT and decoder again in a model thread. So later calls wait for the first.
        self._first_ended: dict[str, threading.Event] = {}
        # First calls under way, and how many have begun: torch's compile counters are the process's, so a call
        # beside another's first call would count that one's compiles as its own.
        self._compiling = 0
        self._begun = 0
        # Whether each shape's first call here built kernels: a call that waited for it waited for a compile.
        self._built: dict[str, bool] = {}

    def compiles(self, component: str, detail: str) -> bool:
        return (component, None) in self.watched or (component, detail) in self.watched

    @contextmanager
    def __call__(self, component: str, shape: tuple[int, ...], detail: str = "") -> Iterator[None]:
        if not self.compiles(component, detail):
            yield
            return
        key = shape_key(component, shape, detail)
        first_here, ended = self._first_call(key)
        if not first_here and not ended.is_set():
            waited_from = time.time()
            ended.wait()
            if self._built.get(key):
                _note_compile_span(waited_from, time.time())
        with self._lock:
            busy, begun = self._compiling > first_here, self._begun
        announced = first_here and not _marker(self.root, key).exists()
        if announced:
            warnings.warn(
                f"compiling GPU kernels for the {component} at {'x'.join(map(str, shape))} "
                f"(first run on this machine for this shape: {self.estimate}; later runs reuse "
                f"{self.root}; `k6vsr cache import FILE` brings another machine's kernels)",
                CompileNotice,
                stacklevel=3,
            )
        before = CompileCounts.now()
        started, started_at = time.perf_counter(), time.time()
        try:
            yield
        finally:
            done = CompileCounts.now() - before
            if first_here:
                self._built[key] = done.built > 0
                self._first_call_ended(ended)
        if first_here and done.built:
            _note_compile_span(started_at, time.time())
        with self._lock:
            alone = not busy and self._compiling == 0 and self._begun == begun
        if done.graphs:
            log.info(
                "the %s at %s: %d graphs compiled in %.1f s (%d built, %d from the cache)",
                component,
                "x".join(map(str, shape)),
                done.graphs,
                time.perf_counter() - started,
                done.built,
                done.loaded,
            )
        if done.built and not announced and alone:
            # A compile the shape markers did not foresee: the kernels were not where this process looked.
            who = "this machine" if first_here else "this process"
            warnings.warn(
                f"compiled {done.built} graphs of the {component} at {'x'.join(map(str, shape))} in "
                f"{time.perf_counter() - started:.0f} s although {who} ran this shape before: Inductor's cache "
                f"({_inductor_cache_dir()}) did not hold them for this process's settings (another "
                "TORCHINDUCTOR_CACHE_DIR, torch version, thread count or a guard that differs); "
                "TORCH_LOGS=recompiles says which",
                CompileNotice,
                stacklevel=3,
            )
        if first_here:
            _write_marker(self.root, key)
            save_process_artifacts(self.root)

    def _first_call(self, key: str) -> tuple[bool, threading.Event]:
        """Whether this is the first call of `key` in this process, and the event its end sets."""
        with self._lock:
            ended = self._first_ended.get(key)
            if ended is not None:
                return False, ended
            ended = self._first_ended[key] = threading.Event()
            self._compiling += 1
            self._begun += 1
            return True, ended

    def _first_call_ended(self, ended: threading.Event) -> None:
        with self._lock:
            self._compiling -= 1
        ended.set()  # a first call that failed frees the others too: the next one compiles


_spans = threading.local()


@contextmanager
def compile_spans() -> Iterator[list[tuple[float, float]]]:
    """The wall-clock spans (`time.time()`) in which this thread, inside the block, compiled kernels for a shape's
    first call or waited for another thread's: one-time costs that a later process with a warm cache does not pay,
    and that a measure of a stage's pace leaves out (`flows.preview`)."""
    spans: list[tuple[float, float]] = []
    outer = getattr(_spans, "into", None)
    _spans.into = spans
    try:
        yield spans
    finally:
        _spans.into = outer


def _note_compile_span(start: float, end: float) -> None:
    into = getattr(_spans, "into", None)
    if into is not None:
        into.append((start, end))


class CompileCounts(BaseModel):
    """The process's compile counters (torch's own): frames Dynamo compiled, and Inductor graphs built or loaded."""

    graphs: int
    built: int
    loaded: int

    @classmethod
    def now(cls) -> CompileCounts:
        from torch._dynamo.utils import counters  # no public counter says whether a call compiled

        return cls(
            graphs=counters["frames"]["ok"],
            built=counters["inductor"]["fxgraph_cache_miss"],
            loaded=counters["inductor"]["fxgraph_cache_hit"],
        )

    def __sub__(self, other: CompileCounts) -> CompileCounts:
        return CompileCounts(
            graphs=self.graphs - other.graphs, built=self.built - other.built, loaded=self.loaded - other.loaded
        )


def _inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


# ---------------------------------------------------------------------------------------------------- artefacts


def save_process_artifacts(root: Path | None = None) -> Path | None:
    """This process's compiled and loaded artefacts, as one file in `<cache>/artifacts` (replaced atomically)."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    data, _info = saved
    folder = (root or compile_cache_dir()) / "artifacts"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{platform.node() or 'host'}-{os.getpid()}.bin"
    temp = path.with_suffix(".tmp")
    temp.write_bytes(data)
    os.replace(temp, path)
    for old in sorted(folder.glob("*.bin"), key=lambda p: p.stat().st_mtime)[:-KEEP_PROCESS_FILES]:
        old.unlink(missing_ok=True)
    return path


def export_cache(destination: Path, root: Path | None = None) -> CacheManifest:
    """Pack the cache's artefact files and shape markers into one zip, written atomically."""
    root = root or compile_cache_dir()
    files = sorted((root / "artifacts").glob("*.bin")) if (root / "artifacts").is_dir() else []
    if not files:
        raise FileNotFoundError(f"{root} holds no compiled kernels to export: run a clip on this machine's GPU first")
    stack = _stack()
    manifest = CacheManifest(
        torch=str(stack["torch"]),
        cuda=stack["cuda"],
        triton=stack["triton"],
        device=stack["device"],
        machine=platform.machine(),
        shapes=known_shapes(root),
        artifacts=[f.name for f in files],
        created_at=time.time(),
    )
    destination.parent.mkdir(parents=True, exist_ok=True)
    temp = destination.with_name(f".{destination.name}.{os.getpid()}.tmp")
    with zipfile.ZipFile(temp, "w", compression=zipfile.ZIP_LZMA) as archive:
        archive.writestr(ARCHIVE_MANIFEST, manifest.model_dump_json(indent=2))
        for path in files:
            archive.write(path, f"artifacts/{path.name}")
    os.replace(temp, destination)
    return manifest


def read_manifest(source: Path) -> CacheManifest:
    try:
        with zipfile.ZipFile(source) as archive:
            return CacheManifest.model_validate_json(archive.read(ARCHIVE_MANIFEST))
    except (zipfile.BadZipFile, KeyError, ValueError) as err:
        raise ValueError(f"{source} is not a k6vsr compile cache file ({err})") from None


def import_cache(source: Path, root: Path | None = None) -> dict[str, Any]:
    """Load an exported file's artefacts into this machine's caches; marks its shapes compiled where they hit.

    A file made on another torch or GPU model is refused: none of its kernels could hit here.
    """
    manifest = read_manifest(source)
    stack = _stack()
    mismatched = [
        f"{name} {getattr(manifest, name)} (here {stack[name]})"
        for name in ("torch", "device")
        if getattr(manifest, name) != stack[name]
    ]
    if mismatched:
        raise ValueError(f"{source} was compiled for another stack: {', '.join(mismatched)}")
    root = root or compile_cache_dir()
    enable_compile_cache(root)
    loaded = 0
    with zipfile.ZipFile(source) as archive:
        for name in manifest.artifacts:
            if torch.compiler.load_cache_artifacts(archive.read(f"artifacts/{name}")) is not None:
                loaded += 1
    for key in manifest.shapes:
        _write_marker(root, key)
    return {"file": str(source), "artifact_files": loaded, "shapes": manifest.shapes, "cache": str(root)}


_IMPORTED: set[str] = set()


def import_configured_artifacts() -> dict[str, Any] | None:
    """Import `$K6VSR_COMPILE_ARTIFACTS` once per process (deployments and warm workers set it)."""
    configured = settings.read(settings.Compute).compile_artifacts
    source = None if configured is None else str(configured)
    if not source or source in _IMPORTED:
        return None
    _IMPORTED.add(source)
    try:
        result = import_cache(Path(source).expanduser())
    except (OSError, ValueError) as err:
        log.warning("%s=%s not imported: %s", ARTIFACTS_ENV, source, err)
        return None
    log.info("compile cache imported from %s: %d artefact files", source, result["artifact_files"])
    return result
