"""Where a store's bytes live: a local folder, or a prefix in an object store (`s3://bucket/prefix`).

Both kinds answer the same small set of operations, each one whole: a reader sees an object (or file) as it was
before a write or after it, never a part. A folder does it with a temporary file and a rename; an object store
publishes an object only when its upload completes. Object stores are reached through fsspec (s3fs for `s3://`),
which reads the usual AWS_* settings (credentials, region, AWS_ENDPOINT_URL) and is what Zarr's own FsspecStore uses.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from functools import wraps
from pathlib import Path
from typing import Any, ClassVar, ParamSpec, TypeVar

import fsspec
from fsspec.spec import AbstractFileSystem

from k6vsr_core.errors import StoreError
from storage.processes import alive

BLOCK = 1 << 20

P = ParamSpec("P")
R = TypeVar("R")


class StoreUnreachable(StoreError):
    """The object store did not answer (after its client's own retries): what the run finished stays stored there,
    and the same command resumes once it answers again."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the new one, never a part.

    The temporary file's name carries its writer (`owner`): a killed writer's is removed by `remove_dead_partials`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{owner()}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def owner() -> str:
    """`<host>-<pid>`: who wrote a temporary file, so a later run can tell a dead writer's leftovers."""
    return f"{socket.gethostname()}-{os.getpid()}"


def remove_stale_temps(folder: Path, prefix: str, suffix: str) -> list[Path]:
    """Delete `<prefix><host>-<pid>.*<suffix>` files in `folder` left by dead processes of this host."""
    mine = f"{prefix}{socket.gethostname()}-"
    return _remove_orphans(
        folder, lambda name: name[len(mine) :] if name.startswith(mine) and name.endswith(suffix) else None
    )


def remove_dead_partials(folder: Path) -> list[Path]:
    """Delete the `.<name>.<host>-<pid>.*.partial` files of `atomic_write_bytes` in `folder` whose writer, a process
    of this host, is dead: one pass over a folder of many small records (a pass per write would cost its square)."""
    marker = f".{socket.gethostname()}-"
    return _remove_orphans(
        folder, lambda name: name.rsplit(marker, 1)[1] if name.endswith(".partial") and marker in name else None
    )


def _remove_orphans(folder: Path, writer: Callable[[str], str | None]) -> list[Path]:
    """Delete the files of `folder` whose name's `writer(name)` (None: not a temporary file; else `<pid>.<rest>`)
    names a dead process."""
    removed: list[Path] = []
    try:
        candidates = [(p, writer(p.name)) for p in folder.iterdir()]
    except OSError:
        return removed
    for path, tail in candidates:
        pid = tail.split(".", 1)[0] if tail is not None else ""
        if pid.isdigit() and not alive(int(pid)):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed


def file_checksum(path: Path, block: int = BLOCK) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def is_url(root: str | Path) -> bool:
    """An object-store URL (`s3://...`, any fsspec protocol) rather than a folder."""
    return isinstance(root, str) and "://" in root and not root.startswith("file://")


def parse_store_root(value: str | Path) -> str | Path:
    """A `--store` / K6VSR_STORE value: a URL kept as written, else a folder (`~` expanded)."""
    return str(value).rstrip("/") if is_url(value) else Path(value).expanduser()


def location(root: str | Path) -> Location:
    """The store root `root` (a folder, or an object-store URL) as a Location."""
    if not is_url(root):
        return LocalLocation(Path(root))
    try:
        # No listings cache: other processes write the same prefixes, and a stale listing would hide their objects.
        fs, path = fsspec.url_to_fs(str(root), use_listings_cache=False)
    except ImportError as err:
        raise StoreError(f"store {root}: its protocol needs a package that is not installed ({err})") from None
    return RemoteLocation(fs, path.rstrip("/"))


class Location(ABC):
    """A file or folder in a store; `/` names a child."""

    remote: ClassVar[bool]  # in an object store: no locks, no appends, no renames (`storage.leases` stands in)

    @abstractmethod
    def __truediv__(self, name: str) -> Location: ...

    @abstractmethod
    def __str__(self) -> str: ...

    @property
    @abstractmethod
    def name(self) -> str: ...

    @property
    @abstractmethod
    def parent(self) -> Location: ...

    @abstractmethod
    def local(self) -> Path:
        """The local path; a StoreError for an object in an object store (read it with `fetch`)."""

    @abstractmethod
    def read_bytes(self) -> bytes:
        """The whole content; FileNotFoundError when absent."""

    @abstractmethod
    def write_bytes(self, data: bytes) -> None:
        """Replace the content as a whole."""

    @abstractmethod
    def put(self, file: Path, *, exclusive: bool = False) -> bool:
        """Make the finished local `file` this one's content, whole (a local file is moved, else uploaded and left for
        the caller to remove). `exclusive`:
        only if absent, decided by the store (a conditional write), so of two racing writers one wins; False when
        it was already there."""

    @abstractmethod
    def copy_to(self, file: Path) -> None:
        """Write the content into the local `file`."""

    @abstractmethod
    def checksum(self) -> str | None:
        """SHA-256 of the content; None when absent."""

    @abstractmethod
    def names(self, suffix: str) -> list[str]:
        """The names of the children ending in `suffix`."""

    @abstractmethod
    def remove(self) -> None:
        """Delete the file (or object), if there."""

    @abstractmethod
    def remove_tree(self) -> None:
        """Delete the folder (or every object under the prefix), if there."""

    @abstractmethod
    def zarr_store(self) -> str:
        """What `zarr.open_group(store=...)` takes for a hierarchy rooted here."""

    @abstractmethod
    def reaching(self) -> AbstractContextManager[None]:
        """A block that talks to the store: an unreachable store ends it with a `StoreUnreachable`."""

    @contextmanager
    def fetch(self) -> Iterator[Path]:
        """A local file with the content, for readers that need one (PyAV, memory maps): the file itself when
        local, else a private download removed afterwards."""
        with tempfile.TemporaryDirectory(prefix="k6vsr-fetch-") as folder:
            file = Path(folder) / self.name
            self.copy_to(file)
            yield file

    def scratch_file(self, suffix: str) -> Path:
        """A private local file to write this one's content into before `put`: in the system's temporary folder
        here (an object store uploads it whole); a folder's is beside it, so that `put`'s rename is atomic."""
        fd, tmp = tempfile.mkstemp(prefix=f".part.{owner()}.", suffix=suffix)
        os.close(fd)
        return Path(tmp)

    @contextmanager
    def appended(self, suffix: str) -> Iterator[Path]:
        """A local file whose content becomes this one's: the file itself in a folder (appended to in place); for
        an object, a private file uploaded whole when the block ends, even by an error (which is raised, not the
        upload's own: often the same unreachable store)."""
        tmp = self.scratch_file(suffix)
        try:
            yield tmp
        except BaseException:
            with suppress(StoreError):
                self.put(tmp)
            raise
        else:
            self.put(tmp)
        finally:
            tmp.unlink(missing_ok=True)


class LocalLocation(Location):
    remote = False

    def __init__(self, path: Path) -> None:
        self.path = path

    def __truediv__(self, name: str) -> LocalLocation:
        return LocalLocation(self.path / name)

    def __str__(self) -> str:
        return str(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def parent(self) -> LocalLocation:
        return LocalLocation(self.path.parent)

    def local(self) -> Path:
        return self.path

    def read_bytes(self) -> bytes:
        return self.path.read_bytes()

    def write_bytes(self, data: bytes) -> None:
        atomic_write_bytes(self.path, data)

    def put(self, file: Path, *, exclusive: bool = False) -> bool:
        # Twins of one run write the same bytes, so a rename over the other's file is as good as a refusal.
        os.replace(file, self.path)
        return True

    def copy_to(self, file: Path) -> None:
        shutil.copyfile(self.path, file)

    def checksum(self) -> str | None:
        return file_checksum(self.path) if self.path.is_file() else None

    def names(self, suffix: str) -> list[str]:
        return [p.name for p in self.path.glob(f"*{suffix}")] if self.path.is_dir() else []

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def remove_tree(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def zarr_store(self) -> str:
        return str(self.path)

    def reaching(self) -> AbstractContextManager[None]:
        return nullcontext()

    @contextmanager
    def fetch(self) -> Iterator[Path]:
        yield self.path

    def scratch_file(self, suffix: str) -> Path:
        # The next writer here removes those of dead processes: the name carries host and pid.
        folder = self.path.parent
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(folder, ".part.", suffix)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".part.{owner()}.", suffix=suffix)
        os.close(fd)
        return Path(tmp)

    @contextmanager
    def appended(self, suffix: str) -> Iterator[Path]:
        yield self.path


def _connection_errors() -> tuple[type[BaseException], ...]:
    """What s3fs's client raises when no endpoint answers (botocore comes with s3fs, an optional dependency)."""
    try:
        from botocore.exceptions import ConnectionError, HTTPClientError
    except ImportError:
        return ()
    return (ConnectionError, HTTPClientError)


def _reached(method: Callable[P, R]) -> Callable[P, R]:
    @wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        location: Any = args[0]
        with location.reaching():
            return method(*args, **kwargs)

    return wrapper


class RemoteLocation(Location):
    remote = True

    def __init__(self, fs: AbstractFileSystem, path: str) -> None:
        self.fs = fs
        self.path = path

    def __truediv__(self, name: str) -> RemoteLocation:
        return RemoteLocation(self.fs, f"{self.path}/{name}")

    def __str__(self) -> str:
        return self.fs.unstrip_protocol(self.path)

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemoteLocation:
        return RemoteLocation(self.fs, self.path.rsplit("/", 1)[0])

    def local(self) -> Path:
        raise StoreError(f"{self} is in an object store, not on this machine's disk")

    @contextmanager
    def reaching(self) -> Iterator[None]:
        try:
            yield
        except _connection_errors() as err:
            raise StoreUnreachable(
                f"{self}: the object store does not answer ({err}); what the run finished is kept there, "
                "run the same command again once it answers"
            ) from None

    @_reached
    def read_bytes(self) -> bytes:
        return self.fs.cat_file(self.path)

    @_reached
    def write_bytes(self, data: bytes) -> None:
        self.fs.pipe_file(self.path, data)

    @_reached
    def put(self, file: Path, *, exclusive: bool = False) -> bool:
        try:
            # s3fs sends `If-None-Match: *` for mode="create": the store, not a check beforehand, refuses the loser.
            self.fs.put_file(str(file), self.path, mode="create" if exclusive else "overwrite")
        except FileExistsError:
            return False
        return True

    @_reached
    def create(self, data: bytes) -> bool:
        """Write `data` only if there is no object yet (a conditional write); False when there was one."""
        try:
            self.fs.pipe_file(self.path, data, mode="create")
        except FileExistsError:
            return False
        return True

    @_reached
    def copy_to(self, file: Path) -> None:
        self.fs.get_file(self.path, str(file))

    @_reached
    def checksum(self) -> str | None:
        digest = hashlib.sha256()
        try:
            with self.fs.open(self.path, "rb", block_size=BLOCK, cache_type="none") as handle:
                while chunk := handle.read(BLOCK):
                    digest.update(chunk)
        except FileNotFoundError:
            return None
        return digest.hexdigest()

    @_reached
    def names(self, suffix: str) -> list[str]:
        try:
            found = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return []
        return [name.rsplit("/", 1)[-1] for name in found if name.endswith(suffix)]

    @_reached
    def remove(self) -> None:
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            pass

    @_reached
    def objects(self) -> dict[str, tuple[int, float]]:
        """Every object under this prefix: its name below it, size and time of last change (seconds)."""
        found = self.fs.find(self.path, detail=True)
        return {
            name.removeprefix(self.path + "/"): (int(info["size"]), info["LastModified"].timestamp())
            for name, info in found.items()
            if info["type"] == "file"
        }

    @_reached
    def remove_all(self, names: list[str]) -> None:
        """Delete the objects `names` below this prefix, in as few requests as the store allows."""
        if names:
            self.fs.rm([f"{self.path}/{name}" for name in names])

    @_reached
    def remove_tree(self) -> None:
        try:
            self.fs.rm(self.path, recursive=True)
        except FileNotFoundError:
            pass

    def zarr_store(self) -> str:
        return str(self)
