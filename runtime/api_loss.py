"""How a Prefect API that stops answering is told apart from every other error: a connection error of the client
(after its own retries) on a request to that API's address, anywhere in the error's chain."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.service_errors import ServerError

if TYPE_CHECKING:
    import httpx


def transport_errors(err: BaseException) -> Iterator[httpx.TransportError]:
    """The httpx connection errors (refused, reset, timed out) in `err`'s chain of causes, `err` first."""
    import httpx

    seen: set[int] = set()
    inner: BaseException | None = err
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        if isinstance(inner, httpx.TransportError):
            yield inner
        inner = inner.__cause__ or inner.__context__


def lost_api(err: BaseException, url: str, local_home: Path | None = None) -> ServerError | None:
    """What to tell the user when `err` comes of the API at `url` no longer answering (a local server in
    `local_home` that was killed, a remote one gone), None when it does not: the client's own retries (a minute)
    are spent by then, and its last error, a bare `ConnectError`, names neither the server nor what to do."""
    for inner in transport_errors(err):
        if _asked(inner, url):
            said = f"{type(inner).__name__}: {inner}"
            if local_home is not None:
                return ServerError(
                    f"the local Prefect server (state folder {local_home}) stopped answering at {url} during the "
                    f"run ({said}); finished items are kept: rerun to resume, the next command starts the server "
                    "again"
                )
            return ServerError(
                f"the Prefect API at {url} stopped answering during the run ({said}); finished items are kept: "
                "rerun to resume once it answers"
            )
    return None


def _asked(err: BaseException, url: str) -> bool:
    """Whether `err` (an httpx error) was raised by a request to the API at `url`, not another server's."""
    import httpx

    try:
        request = err.request  # type: ignore[attr-defined]  # httpx.RequestError's; raises where none was set
    except RuntimeError:
        return False
    api = httpx.URL(url)
    return (request.url.host, request.url.port) == (api.host, api.port)
