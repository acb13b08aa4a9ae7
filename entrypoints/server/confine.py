"""Client paths of the HTTP API: opening a `video_path` only inside the allowed folders, and keeping the server's own
paths out of what clients read.

A path checked when a job is submitted and opened again later can be swapped in between (a file replaced by a
symbolic link to a file outside). So a path is resolved once, checked against the allowed folders, and then opened
component by component from `/` with `O_NOFOLLOW`: the file opened is the one at the checked path, with no symbolic
link followed on the way. A link that appears after the check makes the open fail; the server never follows it, so
no answer depends on what lies outside the allowed folders. The caller copies the opened file into the job's own
folder and everything downstream reads that copy.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

# At most this much of a client's text is quoted back in a message.
QUOTE_CHARS = 80


class PathRefused(Exception):
    """A `video_path` the server will not read; `forbidden`: outside the allowed folders (403), else bad (400)."""

    def __init__(self, code: str, message: str, forbidden: bool = False) -> None:
        super().__init__(message)
        self.code, self.message, self.forbidden = code, message, forbidden


@dataclass(frozen=True)
class ConfinedFile:
    fd: int  # open for reading; the caller closes it
    relative: str  # the path below its allowed folder: the only form a client is shown
    size: int


def quote(text: str) -> str:
    """A client's text as it may appear in a one-line message: escaped, and cut when long."""
    shown = text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "..."
    return repr(shown)


def open_confined(raw: object, roots: tuple[Path, ...]) -> ConfinedFile:
    """Open the regular file `raw` names for reading, if it lies inside one of `roots` (resolved folders)."""
    if not isinstance(raw, str) or not raw:
        raise PathRefused(
            "missing_video_path",
            "video_path must be a non-empty string (or upload the clip as multipart field 'video_reference')",
        )
    if not roots:
        raise PathRefused(
            "paths_not_allowed",
            "video_path is not allowed on this server: start it with "
            "--allow-path DIR to accept clips under DIR, or upload the clip as 'video_reference'",
            forbidden=True,
        )
    if not os.path.isabs(raw):  # resolved against the server's working folder, it would name a file of the server's
        raise PathRefused("path_not_absolute", "video_path must be an absolute path inside a folder the server allows")
    try:
        resolved = Path(raw).resolve()
    except (OSError, RuntimeError, ValueError):  # a NUL byte, a loop of links, a name the system refuses
        raise PathRefused("invalid_path", "video_path is not a valid path") from None
    root = next((root for root in roots if resolved.is_relative_to(root)), None)
    if root is None:
        # One answer for every path outside, whether or not it exists: nothing outside is ever looked at again.
        raise PathRefused("path_not_allowed", "video_path is outside the folders this server allows", forbidden=True)
    if resolved == root:
        raise PathRefused("path_not_a_file", "video_path names an allowed folder, not a video file")
    relative = resolved.relative_to(root).as_posix()
    fd = _open_without_links(resolved, quote(relative))
    return ConfinedFile(fd=fd, relative=relative, size=os.fstat(fd).st_size)


def _open_without_links(resolved: Path, shown: str) -> int:
    """Open `resolved` (absolute, free of links when resolved) one component at a time, never following a link."""
    directory = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    *folders, name = resolved.parts[1:]
    component = name
    try:
        for component in folders:
            inner = os.open(component, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
            os.close(directory)
            directory = inner
        component = name
        # Looked at before opening: opening a device or a FIFO can block or have effects of its own.
        _check_regular(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode, shown)
        # O_NONBLOCK: a FIFO swapped in after the look opens at once (and is refused below) instead of blocking.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=directory)
    except OSError as err:
        raise _changed(shown) if _is_link(component, directory) else _refusal(err, shown) from None
    finally:
        os.close(directory)
    try:
        _check_regular(os.fstat(fd).st_mode, shown)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_link(name: str, directory: int) -> bool:
    """Whether `name` in `directory` is a symbolic link (which O_NOFOLLOW reports as ELOOP, or ENOTDIR for a folder)."""
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _check_regular(mode: int, shown: str) -> None:
    if stat.S_ISLNK(mode):
        raise _changed(shown)
    if stat.S_ISDIR(mode):
        raise PathRefused("path_not_a_file", f"video_path {shown} is a directory, not a video file")
    if not stat.S_ISREG(mode):
        raise PathRefused("path_not_a_file", f"video_path {shown} is not a regular file")


def _changed(shown: str) -> PathRefused:
    return PathRefused(
        "path_changed",
        f"video_path {shown} changed while it was being opened (a symbolic link "
        "appeared on the way); send the request again",
    )


def _refusal(err: OSError, shown: str) -> PathRefused:
    import errno

    if err.errno in (errno.ENOENT, errno.ENOTDIR):
        return PathRefused("path_not_found", f"video_path {shown} does not exist")
    if err.errno in (errno.EACCES, errno.EPERM):
        return PathRefused("path_unreadable", f"video_path {shown} is not readable by the server")
    if err.errno == errno.ENAMETOOLONG:
        return PathRefused("invalid_path", "video_path is not a valid path (a name is too long)")
    return PathRefused("path_unreadable", f"video_path {shown} cannot be opened ({os.strerror(err.errno or 0)})")


# An absolute path inside a message: a slash that starts a word, then at least one character of a path.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~/>-])/(?=[^\s/'\"])[^\s'\"()\[\],;:]*")


def scrub_paths(text: str, known: dict[str, str]) -> str:
    """`text` with each known path replaced by its label (longest first) and any other absolute path by `<path>`.

    For messages that come from libraries (a decoder's error names the file it opened): a client never reads where
    the server keeps its files.
    """
    for path in sorted(known, key=len, reverse=True):
        text = text.replace(path, known[path])
    return _ABSOLUTE_PATH.sub("<path>", text)
