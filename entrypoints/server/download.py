"""A job's output served from a file opened before the answer starts: a DELETE (or the janitor) that removes the
output meanwhile unlinks the name only, so every download that got its 200 sends the whole file."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import BinaryIO

import anyio
from starlette.responses import FileResponse
from starlette.types import Receive, Scope, Send

PATHSEND = "http.response.pathsend"


class OpenedFileResponse(FileResponse):
    """Starlette's `FileResponse` (length, ETag, ranges, HEAD) over an open file instead of a path it would open
    (and stat) later, by which time the path may be gone."""

    def __init__(self, file: BinaryIO, media_type: str, filename: str) -> None:
        self._file = file
        super().__init__(
            f"/proc/self/fd/{file.fileno()}",  # never opened: `_open_file` hands out `file`
            media_type=media_type,
            filename=filename,
            stat_result=os.fstat(file.fileno()),
        )

    @asynccontextmanager
    async def _open_file(self) -> AsyncIterator[anyio.AsyncFile[bytes]]:
        self._file.seek(0)
        yield anyio.wrap_file(self._file)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Never `http.response.pathsend`: a server supporting it would open the path, not this file.
        extensions = {name: value for name, value in scope.get("extensions", {}).items() if name != PATHSEND}
        scope = {**scope, "extensions": extensions}
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._file.close()
