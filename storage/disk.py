"""A full disk under the store: which errors are one, and the error that names the disk.

A write that finds no room fails wherever it happens (a Zarr chunk, a record, a segment PyAV writes, the run's
log), often as a bare `OSError(ENOSPC)` that names no file. The clip's flow turns the first such error into one
`DiskFull` that names the store's folder, the mount point of its disk and the bytes left there, and says that a
rerun after freeing space resumes: the store's writes are whole or absent (see `records`), so nothing the full disk
cut short is taken as done.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from k6vsr_core.errors import StoreError

# Out of space, or out of the user's quota of it: the same to the user.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(StoreError):
    """The disk under the run store (or the output folder) has no room left; `folder` is where the write went."""

    errno = errno.ENOSPC

    def __init__(self, folder: str, detail: str) -> None:
        self.folder = folder
        self.detail = detail
        super().__init__(detail)

    def __reduce__(self) -> tuple[type[DiskFull], tuple[str, str]]:
        return (type(self), (self.folder, self.detail))


def is_no_space(err: BaseException | None) -> bool:
    """Whether `err`, or an error it was raised from, is a write that found no space."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, DiskFull) or (isinstance(err, OSError) and err.errno in NO_SPACE):
            return True
        err = err.__cause__ or err.__context__
    return False


def mount_point(path: Path) -> Path:
    """The mount point of the file system that holds `path` (or its nearest existing parent)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    device = path.stat().st_dev
    while path != path.parent and path.parent.stat().st_dev == device:
        path = path.parent
    return path


def disk_full(folder: str | Path, err: BaseException) -> DiskFull:
    """The error to show for `err`, a write under `folder` that found no room."""
    where = str(folder)
    try:
        local = Path(folder)
        mount = mount_point(local)
        free = shutil.disk_usage(mount).free
        disk = f"the disk mounted at {mount} ({free} bytes free)"
    except OSError:
        disk = "its disk"
    cause = os.strerror(errno.ENOSPC)
    return DiskFull(where, f"{where}: {cause} on {disk}; free some space and rerun the same command to resume")
