"""Every error k6vsr raises on purpose, and the one line that every entry point shows for any error.

Three kinds, told apart by what the reader can do:

- `UserFacingError`: the user can fix it (the file, a value, the model, the store, the output folder); its message
  names the file or value and the cause. The command line prints it on one line and exits with 2, the HTTP API
  answers it with a 4xx status, the archive writes it into the clip's row; a stage task never retries it.
- `ServiceError`: a service the command needs could not be started or reached (the runtime's, `runtime.service_errors`);
  its message says where to look. The command line prints it on one line and exits with 1.
- `PipelineError`: k6vsr's own work failed (tiles that failed on every attempt, a stored input that is gone). Like
  any other exception it is an internal failure: shown with its type, exit code 1. An archive whose clips failed
  ends Failed with its summary, which says which and why.

A plain `ValueError` is an internal failure too (a broken invariant, a library refusing what k6vsr passed it): a value
the user gave is checked where it enters and refused as a `ParameterError`.
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
        # Errors cross process boundaries (worker processes): the default reduction would pass the message only.
        return (type(self), (self.path, self.cause))


class UnsupportedColour(MediaError):
    """A source whose colour the output cannot carry faithfully (HDR, wide gamut, an unknown matrix): refused with
    the reason before any work, never written under other tags."""


class BundleError(UserFacingError, RuntimeError):
    """A model bundle that cannot be used; the message names the component and the cause."""


class StoreError(UserFacingError, RuntimeError):
    """The run store is unusable (unwritable root, foreign data under a run key)."""


class ServiceError(RuntimeError):
    """A service a command needs could not be started or reached; the message says which and where its log is."""


class PipelineError(RuntimeError):
    """k6vsr's own work did not finish; what was finished stays stored, so a rerun resumes."""


class TileFailure(PipelineError):
    """Some tiles failed on every attempt; every finished tile stays stored for the next run."""


class MissingInput(PipelineError):
    """A stage's input is not (or no longer) in the store; the flow reruns the stage that makes it."""


class WindowStopped(PipelineError):
    """A task waiting for a window's items was told that they will not come (one failed, or the run stopped)."""


def describe_error(err: BaseException) -> str | None:
    """The one-line message for an error the user can act on; None for an internal failure (or a service's)."""
    if isinstance(err, UserFacingError):
        return str(err)
    if isinstance(err, OSError) and err.filename:  # e.g. a full disk while the output is written
        return f"{err.filename}: {err.strerror}"
    return None
