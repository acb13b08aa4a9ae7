"""The errors a user can fix, and the one line that every entry point shows for any error.

An error the user can fix (the file, a value, the model, the store, the output folder) is a `UserFacingError`; its
message names the file or value and the cause. The command line prints it on one line and exits with 2, the HTTP API
answers it with a 4xx status, the archive writes it into the clip's row. Anything else is an internal failure.
"""

from __future__ import annotations

import os


class UserFacingError(Exception):
    """An error the user can fix; its message is the whole story, so no traceback is shown."""


class ParameterError(UserFacingError, ValueError):
    """A request value outside what the model contract allows."""


class MediaError(UserFacingError, ValueError):
    """An unusable input or output file. `str(err)` names the file and the cause, also kept as `path` and `cause`."""

    def __init__(self, path: str | os.PathLike[str], cause: str) -> None:
        self.path = os.fspath(path)
        self.cause = cause
        super().__init__(f"{self.path}: {cause}")

    def __reduce__(self) -> tuple[type[MediaError], tuple[str, str]]:
        # Errors cross process boundaries (Dask workers): the default reduction would pass the message only.
        return (type(self), (self.path, self.cause))


class BundleError(UserFacingError, RuntimeError):
    """A model bundle that cannot be used; the message names the component and the cause."""


class StoreError(UserFacingError, RuntimeError):
    """The run store is unusable (unwritable root, foreign data under a run key)."""


def describe_error(err: BaseException) -> str | None:
    """The one-line message for an error the user can act on; None for an internal failure."""
    if isinstance(err, UserFacingError):
        return str(err)
    if isinstance(err, ValueError):  # a value refused by a library (pydantic, torch) before any work
        return str(err)
    if isinstance(err, OSError) and err.filename:  # e.g. a full disk while the output is written
        return f"{err.filename}: {err.strerror}"
    return None
