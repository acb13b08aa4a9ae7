"""The services the runtime starts and the errors they raise: each a `ServiceError` (`k6vsr_core.errors`), which the
command prints on one line and exits with 1."""

from __future__ import annotations

from k6vsr_core.errors import ServiceError


class ServerError(ServiceError):
    """The local Prefect server could not be started or reached."""


class WorkersError(ServiceError):
    """The warm workers could not be started."""


class WorkersUnavailable(ServiceError):
    """Worker processes did not run a trivial task in time (not started, or cannot import k6vsr)."""
