"""Who sent a request: API keys, each job's owner, and the admins who see every job."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from entrypoints.server.api_errors import ApiError, error_response
from entrypoints.server.job_records import JobRecord


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the id of its key (never the key), or None on a server without keys, where every client
    is the same one. An admin sees every job."""

    owner: str | None
    admin: bool = False

    def sees(self, job: JobRecord) -> bool:
        return self.admin or self.owns(job)

    def owns(self, job: JobRecord) -> bool:
        return job.owner == self.owner


ANONYMOUS = Caller(owner=None)


def key_owner(key: str) -> str:
    return "key_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def owners_of(keys: Iterable[str]) -> Callable[[bytes], str | None]:
    """The owner of the key an `Authorization` header names, None when it names none of `keys`: who holds a
    connection (`serving`), looked up by the key's digest, before any request of it is authenticated."""
    by_digest = {hashlib.sha256(key.encode()).digest(): key_owner(key) for key in keys}

    def owner(header: bytes) -> str | None:
        scheme, _, token = header.partition(b" ")
        return by_digest.get(hashlib.sha256(token.strip()).digest()) if scheme.lower() == b"bearer" else None

    return owner


def caller_of(request: Request) -> Caller:
    return getattr(request.state, "caller", ANONYMOUS)


# A middleware rather than FastAPI's HTTPBearer: that is a dependency of the routes that declare it, so a path with
# no route would still answer 404 or 405 without a key (telling which paths exist), and its refusal is FastAPI's
# `{"detail": "Not authenticated"}` (fastapi 0.150), not this API's error form. The key check itself would stay ours.
class KeyAuth:
    """Every request needs `Authorization: Bearer <key>` with one of the keys (each compared in constant time); the
    request then carries its `Caller`."""

    def __init__(self, app: Any, callers: dict[str, Caller]) -> None:
        self.app = app
        self.callers = [(key.encode(), caller) for key, caller in callers.items()]

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            found = None
            for key, caller in self.callers:  # every key is compared: the time does not tell which one matched
                if hmac.compare_digest(token.strip(), key) and scheme.lower() == b"bearer":
                    found = caller
            if found is None:
                message = "missing API key" if not header else "invalid API key"
                response = error_response(
                    ApiError(
                        401,
                        f"{message}: send the header 'Authorization: Bearer <key>'",
                        code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"},
                    )
                )
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["caller"] = found
        await self.app(scope, receive, send)
