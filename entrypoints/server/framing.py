"""A request framed two ways, with both `Content-Length` and `Transfer-Encoding`: h11 reads its body by the
`Transfer-Encoding` alone, and RFC 9112 (section 6.1) says the connection must then be closed after the answer, so
that a proxy that read the other length cannot smuggle a request into what follows."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
CLOSE = (b"connection", b"close")


def framed_twice(headers: list[tuple[bytes, bytes]]) -> bool:
    names = {name.lower() for name, _ in headers}
    return b"content-length" in names and b"transfer-encoding" in names


class CloseAmbiguousFraming:
    """Answers a request framed twice as usual, with `Connection: close`: the server closes the connection after
    it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(
        self, scope: Message, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http" or not framed_twice(scope["headers"]):
            await self.app(scope, receive, send)
            return

        async def closing(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(name, value) for name, value in message.get("headers", []) if name.lower() != b"connection"]
                message = {**message, "headers": [*headers, CLOSE]}
            await send(message)

        await self.app(scope, receive, closing)
