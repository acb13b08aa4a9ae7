"""The run store: where the bytes of every stage of a run live, and how their completion is known.

Layout of one run, under `<root>/runs/<run key>/`:

    manifest.json          what the run is (source, parameters, plan, seeds, versions); written atomically at ingest
                           (again only to follow a source of the same content to a new path)
    audio.f32              the source's audio as mono float32 samples, trimmed to the output's span
    data.zarr/             per (window, tile): latent, tile_latents, tiles; per window: video (Zarr v3, one chunk
                           per writer unit); frame_pts (where each source frame is, to seek to a window)
    segments/<window>.mp4  each window's encoded frames, joined into the output by stream copy
    source.<ext>           in an object store only: the source (or latent file) as ingest found it, which the
                           workers read their windows from
    done/<stage>/<item>    completion records with checksums (see `records`); items are `<window>` or
                           `<window>-<tile>`
    output.mp4             the muxed result, published atomically
    quality.json           the output's quality report (`tasks.quality`), once measured
    run.log                what the flow runs of this run and their tasks logged
    .lock                  held (shared) by every live run, so `gc` never deletes a store in use

The root may also be an object-store URL (`s3://bucket/prefix`, see `storage.location`): the same layout, as
objects. There every file is written whole (uploaded from a private local file), the store's output only if absent
(a conditional write), and a run's log goes to `logs/<attempt>.log`, since objects cannot be appended to.

Arrays written by concurrent tasks have exactly one chunk per (window, tile) and no sharding: Zarr supports
concurrent writes to distinct chunks only. Latents are stored as float32, so a decode reads back exactly what the
denoise produced. A window's intermediates are deleted once nothing will read them again (see `drop_window`), so the
store holds a few windows at a time, whatever the length of the video.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from pydantic import BaseModel, ConfigDict
from zarr.errors import ContainsArrayError

from k6vsr_core import settings
from k6vsr_core.contract.stage_names import Stage
from k6vsr_core.errors import StoreError
from storage import leases
from storage.location import (
    LocalLocation,
    Location,
    RemoteLocation,
    StoreUnreachable,
    file_checksum,
    location,
    owner,
    parse_store_root,
    remove_dead_partials,
    remove_stale_temps,
)
from storage.manifest import RunManifest
from storage.records import RecordBook, array_checksum, damaged

RUNS = "runs"
OUTPUT = "output.mp4"
LOG = "run.log"
AUDIO = "audio.f32"
SEGMENTS = "segments"
SOURCE = "source"
STOPS = "stops"  # `<attempt>-<window>`: that attempt will not finish that window's model work
# Sources a process keeps downloaded from object stores (`RunStore.source_file`): the windows of the clips it works
# on now read them again and again; older ones are deleted.
SOURCES_KEPT = 4


def default_store_root() -> str | Path:
    """`$K6VSR_STORE` (a folder or an object-store URL), else the per-user cache folder."""
    explicit = settings.read(settings.Store).store
    if explicit:
        return parse_store_root(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "k6vsr" / "store"


class RunRef(BaseModel):
    """Where one run lives: the store and the run's key, as plain strings that travel between processes and into
    Prefect's parameters; `open()` is the run store they name."""

    model_config = ConfigDict(frozen=True)

    store_root: str  # a folder, or an object-store URL (`s3://bucket/prefix`)
    run_key: str

    def open(self) -> RunStore:
        return RunStore(self.store_root, self.run_key)


class RunStore:
    """One run's folder (or prefix). Cheap to construct: every method opens what it needs, so any process can use
    it."""

    def __init__(self, root: str | Path, run_key: str) -> None:
        self.run_key = run_key
        self.where = location(root) / RUNS / run_key
        self.records = RecordBook(self.where / "done")

    @property
    def remote(self) -> bool:
        return self.where.remote

    @property
    def path(self) -> Path:
        """The run's folder, in a local store."""
        return self.where.local()

    # ------------------------------------------------------------------------------------------- manifest

    @property
    def manifest_path(self) -> Location:
        return self.where / "manifest.json"

    def write_manifest(self, manifest: RunManifest) -> None:
        if manifest.run_key != self.run_key:
            raise StoreError(f"manifest of run {manifest.run_key} cannot go into run {self.run_key}")
        self.manifest_path.write_bytes(json.dumps(manifest.model_dump(mode="json"), indent=2, sort_keys=True).encode())

    def read_manifest(self) -> RunManifest:
        return RunManifest.model_validate_json(self.manifest_path.read_bytes())

    # ------------------------------------------------------------------------------------------- arrays

    def _group(self) -> zarr.Group:
        return zarr.open_group(store=(self.where / "data.zarr").zarr_store(), mode="a")

    def _stored(self, name: str) -> zarr.Array:
        """The stored array `name` (a group of that name is a damaged store)."""
        found = self._group()[name]
        if not isinstance(found, zarr.Array):
            raise StoreError(f"run {self.run_key}: stored {name} is a group, not an array")
        return found

    def _array(self, name: str, shape: tuple[int, ...], chunks: tuple[int, ...], dtype: str) -> zarr.Array:
        """Open or create an array; creating never overwrites, so a concurrent run's chunks survive."""
        group = self._group()
        if name not in group:
            try:
                # Latents and pixels barely compress, and checksums already guard integrity.
                group.create_array(name, shape=shape, chunks=chunks, dtype=dtype, compressors=None, fill_value=0)
            except ContainsArrayError:
                pass
        array = self._stored(name)
        if tuple(array.shape) != tuple(shape) or array.dtype != np.dtype(dtype):
            raise StoreError(
                f"run {self.run_key}: stored {name} is {array.dtype}{array.shape}, expected {dtype}{shape}"
            )
        return array

    def put(
        self, name: str, value: np.ndarray, *, stage: Stage, item: str = "all", seconds: float = 0.0, attempt: str = ""
    ) -> None:
        """Store a whole array (one writer), then its record, naming the run attempt that computed it."""
        with self.where.reaching():
            array = self._array(name, value.shape, value.shape if value.ndim else (1,), value.dtype.str)
            array[...] = value
        self.records.write(stage, item, array_checksum(value), seconds, attempt)

    def get(self, name: str, *, stage: Stage, item: str = "all") -> np.ndarray | None:
        """The stored array if its record exists and its checksum matches, else None (recompute it)."""
        record = self.records.read(stage, item)
        if record is None:
            return None
        return self._verified(name, (), record.checksum, stage, item)

    def _verified(self, name: str, key: tuple[int, ...], checksum: str, stage: Stage, item: str) -> np.ndarray | None:
        """Part `key` of array `name` (all of it for `()`) if it matches `checksum`; a stored chunk that does not is
        reported as damaged. One that is not there (deleted with its window, never written) is not."""
        try:
            with self.where.reaching():
                value = np.asarray(self._stored(name)[key if key else ...])
        except StoreUnreachable:
            raise  # not an answer about the chunk
        except Exception as err:  # noqa: BLE001 - a damaged chunk can fail in many ways; all mean 'recompute'
            if self._chunk_stored(name, key):
                damaged(self._chunk_folder(name, key), f"the stored {name} of {stage} {item} cannot be read ({err})")
            return None
        if array_checksum(value) == checksum:
            return value
        if self._chunk_stored(name, key):
            damaged(self._chunk_folder(name, key), f"the stored {name} of {stage} {item} does not match its checksum")
        return None

    def _chunk_folder(self, name: str, key: tuple[int, ...]) -> Location:
        # Zarr v3's default chunk keys: c/<i>/<j>/... under the array's folder.
        folder = self.where / "data.zarr" / name / "c"
        for part in key:
            folder = folder / str(part)
        return folder

    def _chunk_stored(self, name: str, key: tuple[int, ...]) -> bool:
        """Whether any chunk of part `key` is stored (a deleted or unwritten one reads as the fill value)."""
        folder = self._chunk_folder(name, key)
        return folder.name in folder.parent.names("")

    def put_tile(
        self,
        name: str,
        key: tuple[int, ...],
        counts: tuple[int, ...],
        value: np.ndarray,
        *,
        stage: Stage,
        seconds: float = 0.0,
        attempt: str = "",
    ) -> None:
        """Store part `key` (e.g. (window, tile)) of an array of `counts` parts, each its own chunk, then its
        record (item `<window>-<tile>`)."""
        with self.where.reaching():
            array = self._array(name, (*counts, *value.shape), (*(1 for _ in counts), *value.shape), value.dtype.str)
            array[key] = value
        self.records.write(stage, item_name(key), array_checksum(value), seconds, attempt)

    def get_tile(self, name: str, key: tuple[int, ...], *, stage: Stage) -> np.ndarray | None:
        """Part `key`, verified against its record; None when it is not done, damaged or deleted."""
        record = self.records.read(stage, item_name(key))
        if record is None:
            return None
        return self._verified(name, key, record.checksum, stage, item_name(key))

    def tile_done(self, name: str, key: tuple[int, ...], *, stage: Stage) -> bool:
        """Recorded, stored and intact. Without a record (a first run) it reads nothing."""
        return self.get_tile(name, key, stage=stage) is not None

    def tile_recorded(self, stage: Stage, key: tuple[int, ...]) -> bool:
        """Whether part `key` has a completion record, reading only the record (not the part, as `tile_done` does):
        what a task waiting for another's output asks again and again."""
        return self.records.read(stage, item_name(key)) is not None

    def stop_window(self, window: int, attempt: str) -> None:
        """Tell `attempt`'s tasks that wait for window `window`'s items (its blend) that some will never come."""
        (self.where / STOPS / f"{attempt}-{window}").write_bytes(b"")

    def window_stopped(self, window: int, attempt: str) -> bool:
        try:
            (self.where / STOPS / f"{attempt}-{window}").read_bytes()
        except FileNotFoundError:
            return False
        return True

    def drop_window(self, names: Collection[str], window: int) -> None:
        """Delete window `window`'s chunks of the arrays `names` (records stay: they say the work was done)."""
        for name in names:
            self._chunk_folder(name, (window,)).remove_tree()

    # ------------------------------------------------------------------------------------------- files

    @property
    def audio_path(self) -> Location:
        return self.where / AUDIO

    def segment_path(self, window: int) -> Location:
        return self.where / SEGMENTS / f"{window:06d}.mp4"

    def temp_file(self, destination: Location, suffix: str) -> Path:
        """A private local file to write `destination`'s content into before `commit_file`."""
        return destination.scratch_file(suffix)

    def commit_file(
        self,
        tmp: Path,
        destination: Location,
        stage: Stage,
        item: str,
        seconds: float = 0.0,
        attempt: str = "",
        *,
        exclusive: bool = False,
    ) -> None:
        """Put the finished `tmp` in place whole, then its record. `exclusive` (what several runs may publish at
        once): a conditional write, and a loser accepts the winner's object when its bytes are the same."""
        checksum = file_checksum(tmp)
        if not destination.put(tmp, exclusive=exclusive) and destination.checksum() != checksum:
            # Not a twin's: the leftover of a run whose record was never written (or was damaged). Replace it.
            destination.remove()
            if not destination.put(tmp, exclusive=exclusive):
                raise StoreError(f"run {self.run_key}: {destination} is being written by another run; rerun")
        self.records.write(stage, item, checksum, seconds, attempt)

    def file_done(self, path: Location, stage: Stage, item: str) -> bool:
        """Recorded, present and intact (its bytes match the record)."""
        record = self.records.read(stage, item)
        if record is None:
            return False
        checksum = path.checksum()
        if checksum is not None and checksum != record.checksum:
            damaged(path, f"{stage} {item} does not match its checksum")
        return checksum == record.checksum

    def segment_done(self, window: int) -> bool:
        return self.file_done(self.segment_path(window), Stage.SEGMENT, str(window))

    # ------------------------------------------------------------------------------------------- source

    def source_copy(self, source: str | Path) -> Location:
        """Where an object store keeps the run's source (named with its extension, which some formats need)."""
        return self.where / f"{SOURCE}{Path(source).suffix}"

    def keep_source(self, source: str | Path, attempt: str = "") -> None:
        """In an object store, upload the source once, whole, then its record: a worker on another host reads its
        windows' frames from there, never from this machine's disk. A folder store reads the source where it is."""
        if not self.remote:
            return
        copy = self.source_copy(source)
        if not self.file_done(copy, Stage.INGEST, SOURCE):
            self.commit_file(Path(source), copy, Stage.INGEST, SOURCE, attempt=attempt)

    def source_file(self, manifest: RunManifest) -> Path:
        """A local file with the run's source: the source itself in a folder store; in an object store this
        process's download of the store's copy (checked against its record), kept in the temporary folder under its
        checksum, so the windows of a clip download it once."""
        if not self.remote:
            return Path(manifest.source.path)
        record = self.records.read(Stage.INGEST, SOURCE)
        if record is None:
            raise StoreError(f"run {self.run_key}: its source is not in the store {self.where}; rerun to ingest it")
        folder = Path(tempfile.gettempdir()) / "k6vsr-sources"
        kept = folder / f"{record.checksum}{Path(manifest.source.path).suffix}"
        if kept.is_file():
            os.utime(kept)  # recently used: kept over older ones
            return kept
        folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=folder, prefix=".part.", suffix=kept.suffix)
        os.close(fd)
        tmp = Path(name)
        try:
            self.source_copy(manifest.source.path).copy_to(tmp)
            if file_checksum(tmp) != record.checksum:
                raise StoreError(f"run {self.run_key}: the store's copy of its source is damaged; rerun to ingest it")
            os.replace(tmp, kept)
        finally:
            tmp.unlink(missing_ok=True)
        _keep_newest(folder, SOURCES_KEPT)
        return kept

    # ------------------------------------------------------------------------------------------- output

    @property
    def output_path(self) -> Location:
        return self.where / OUTPUT

    def log_location(self, attempt: str) -> Location:
        """The run's log: what its flow runs and their tasks logged; in a folder one file appended run after run,
        in an object store one object per attempt."""
        return self.where / "logs" / f"{attempt}.log" if self.remote else self.where / LOG

    @contextmanager
    def log_file(self, attempt: str) -> Iterator[Path]:
        """The local file that attempt `attempt` logs into: the log itself in a folder; for an object store a
        private file, uploaded whole when the block ends."""
        with self.log_location(attempt).appended(".log") as file:
            yield file

    def output_done(self) -> bool:
        return self.file_done(self.output_path, Stage.MUX, "all")

    # ------------------------------------------------------------------------------------------- progress

    def attempt_of(self, stage: Stage, item: str = "all") -> str | None:
        """The run attempt whose record says `stage` (`item`) is done; None while it is not recorded."""
        record = self.records.read(stage, item)
        return None if record is None else record.attempt

    def tiles_decoded(self) -> int:
        """(Window, tile) items decoded so far, by any attempt: the progress of a run, cheap enough to poll."""
        return len(self.records.items(Stage.DECODE))

    def decoded_per_window(self, num_windows: int) -> list[int]:
        """Tiles decoded so far in each window."""
        counts = [0] * num_windows
        for item in self.records.items(Stage.DECODE):
            window = int(item.split("-", 1)[0])
            if window < num_windows:
                counts[window] += 1
        return counts

    # ------------------------------------------------------------------------------------------- liveness

    @contextmanager
    def in_use(self) -> Iterator[None]:
        """Hold the run's shared lock for as long as a run uses it (see `gc`); in an object store, which has no
        locks, a lease that expires unless renewed (`storage.leases`)."""
        if isinstance(self.where, RemoteLocation):
            with leases.held(self.where):
                yield
            return
        lock = self.path / ".lock"
        while True:
            self.path.mkdir(parents=True, exist_ok=True)
            handle = lock.open("a")
            fcntl.flock(handle, fcntl.LOCK_SH)
            # `gc` may have deleted the folder, lock file included, while we waited for the lock: a lock on the
            # deleted file protects nothing, so take the lock of the folder as it is now.
            try:
                current = os.stat(lock).st_ino == os.fstat(handle.fileno()).st_ino
            except FileNotFoundError:
                current = False
            if current:
                break
            handle.close()
        try:
            # A killed writer's temporary file is left behind; the next run of the same clip removes it.
            for folder in (self.path, self.path / SEGMENTS):
                remove_stale_temps(folder, ".part.", ".mp4")
            remove_stale_temps(self.path, ".part.", ".f32")
            for folder in (self.path, self.path / STOPS, *self.records.folders()):
                remove_dead_partials(folder)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()


def item_name(key: tuple[int, ...]) -> str:
    """The record item of a part: `3` for window 3, `3-7` for tile 7 of window 3."""
    return "-".join(str(part) for part in key)


def _keep_newest(folder: Path, count: int) -> None:
    """Delete all but the `count` most recently used files of `folder` (other processes may delete them too)."""
    used = {}
    for path in folder.glob("[!.]*"):
        with suppress(FileNotFoundError):
            used[path] = path.stat().st_mtime
    for path in sorted(used, key=used.__getitem__, reverse=True)[count:]:
        path.unlink(missing_ok=True)


def _umask() -> int:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish(source: Location | Path, destination: Path) -> Path:
    """Copy a finished file to `destination` under a temporary name, then rename: no reader sees half a file.

    The file gets the usual permissions of a new file (not the temporary file's owner-only ones). A copy that
    fails (a full disk, say) leaves nothing behind and raises an `OSError` that names `destination`; the
    half-copies of a killed process are removed by the next publish to the same name.
    """
    tmp: str | None = None
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(destination.parent, f".{destination.name}.", ".partial")
        fd, tmp = tempfile.mkstemp(dir=destination.parent, prefix=f".{destination.name}.{owner()}.", suffix=".partial")
        os.close(fd)
        os.chmod(tmp, 0o666 & ~_umask())
        (source if isinstance(source, Location) else LocalLocation(source)).copy_to(Path(tmp))
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, destination)
    except OSError as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise OSError(err.errno, f"could not write the output ({err.strerror or err})", str(destination)) from err
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
    return destination


def run_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def collect_garbage(
    root: str | Path,
    keep_finished_outputs: bool = False,
    older_than_s: float = 0.0,
    run_keys: Collection[str] | None = None,
    dry_run: bool = False,
) -> list[dict]:
    """Delete run folders (all, or those of `run_keys`) that no live run holds. Returns what was (or was not)
    reclaimed, per run; with `dry_run`, what would be, and nothing is deleted."""
    where = location(root)
    if isinstance(where, RemoteLocation):
        return leases.collect(where, keep_finished_outputs, older_than_s, run_keys, dry_run)
    report: list[dict[str, Any]] = []
    runs = Path(root) / RUNS
    if not runs.is_dir():
        return report
    candidates = runs.iterdir() if run_keys is None else (runs / key for key in run_keys)
    for path in sorted(p for p in candidates if p.is_dir()):
        lock = path / ".lock"
        entry: dict[str, Any] = {"run_key": path.name, "bytes": run_size(path)}
        if time.time() - path.stat().st_mtime < older_than_s:
            report.append({**entry, "deleted": False, "reason": "recent"})
            continue
        with lock.open("a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                report.append({**entry, "deleted": False, "reason": "in use by a live run"})
                continue
            if keep_finished_outputs and (path / OUTPUT).is_file():
                for child in path.iterdir():
                    if child.name not in (OUTPUT, "manifest.json", "done", ".lock") and not dry_run:
                        shutil.rmtree(child) if child.is_dir() else child.unlink()
                report.append({**entry, "deleted": True, "reason": leases.reclaimed_reason(True, dry_run)})
            else:
                if not dry_run:
                    shutil.rmtree(path)
                report.append({**entry, "deleted": True, "reason": leases.reclaimed_reason(False, dry_run)})
    return report
