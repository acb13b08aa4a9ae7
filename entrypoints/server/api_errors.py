"""The HTTP server's errors: JSON `{"error": {"message", "type", "param", "code"}}` answers, one line of message."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from entrypoints.server.confine import PathRefused
from entrypoints.server.disk import DISK_FULL_MESSAGE, is_disk_full
from entrypoints.server.error_table import BUSY_ANSWERS, user_answer
from entrypoints.server.messages import short_message
from k6vsr_core.errors import UserFacingError

log = logging.getLogger("k6vsr.server")

RETRY_AFTER_S = 30


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers


_KIND = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    507: "server_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    408: "invalid_request_error",
    429: "rate_limit_error",
}
_CODE = {404: "not_found", 405: "method_not_allowed"}


def api_error(err: UserFacingError, param: str | None = None, message: str | None = None) -> ApiError:
    """The HTTP answer to an error a user can fix: its status and code from the table (`error_table`)."""
    status, code = user_answer(err)
    return ApiError(status, message or str(err), param=param, code=code)


def error_response(err: ApiError) -> JSONResponse:
    """The JSON body (OpenAI's error shape, as SGLang answers) and status of `err`."""
    body = {
        "error": {
            "message": short_message(err.message),
            "type": err.kind or _KIND.get(err.status, "server_error"),
            "param": err.param,
            "code": err.code or _CODE.get(err.status, "http_error"),
        }
    }
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def disk_full_response(request: Request) -> JSONResponse:
    """507: the request's files did not fit on the server's disk (and were removed); `/health` says so too."""
    videos = getattr(request.app.state, "videos", None)
    if videos is not None:
        videos.store.disk.hit()
    return error_response(
        ApiError(
            507,
            f"{DISK_FULL_MESSAGE}: this request's files did not fit and were removed; retry later",
            code="disk_full",
            headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"},  # the rest of the body is never read
        )
    )


def install_error_handlers(app: FastAPI) -> None:
    retry = {"Retry-After": str(RETRY_AFTER_S)}

    @app.exception_handler(ApiError)
    async def api_error_handler(_: Request, err: ApiError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(UserFacingError)
    async def user_error_handler(request: Request, err: UserFacingError) -> JSONResponse:
        if is_disk_full(err):  # e.g. the run store could not be written
            return disk_full_response(request)
        return error_response(api_error(err))

    @app.exception_handler(PathRefused)
    async def path_refused(_: Request, err: PathRefused) -> JSONResponse:
        return error_response(ApiError(403 if err.forbidden else 400, err.message, param="video_path", code=err.code))

    async def busy(_: Request, err: Exception) -> JSONResponse:
        template, code = next(answer for kind, answer in BUSY_ANSWERS.items() if isinstance(err, kind))
        message = template.format(limit=getattr(err, "limit", "?"), why=getattr(err, "why", ""))
        return error_response(ApiError(429, message, code=code, headers=retry))

    for kind in BUSY_ANSWERS:
        app.add_exception_handler(kind, busy)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(ApiError(err.status_code, str(err.detail), headers=getattr(err, "headers", None)))

    @app.exception_handler(ClientDisconnect)
    async def disconnected(_: Request, err: ClientDisconnect) -> JSONResponse:
        return error_response(
            ApiError(400, "the client disconnected before the request body was complete", code="client_disconnected")
        )

    @app.exception_handler(OSError)
    async def os_error(request: Request, err: OSError) -> JSONResponse:
        if is_disk_full(err):
            log.warning("a request failed: %s (%s)", DISK_FULL_MESSAGE, err)
            return disk_full_response(request)
        return await internal_error(request, err)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> JSONResponse:
        log.error("internal error: %s: %s", type(err).__name__, err, exc_info=err)
        return error_response(
            ApiError(500, "internal server error; see the server log", "server_error", code="internal_error")
        )
