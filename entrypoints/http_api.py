"""`k6vsr serve`: SGLang's video job API (`/v1/videos`) on top of the resumable clip flow.

    POST   /v1/videos                JSON {"video_path": ..., "sr_resolution_scale": ..., ...}, or multipart form data
                                     with the clip as file field `video_reference` and the same fields, or with a
                                     latent as file field `latent_reference` (safetensors) and its rate as `fps`;
                                     -> job, queued
    GET    /v1/videos                the caller's jobs, oldest first
    GET    /v1/videos/{id}           the job: status queued | in_progress | completed | failed | cancelled, progress
    GET    /v1/videos/{id}/content   the MP4 once completed (409 before, 404 for an unknown id)
    DELETE /v1/videos/{id}           cancels a queued or running job; removes a finished one and its files

Request fields and their defaults are SGLang's Kandinsky 6 SR sampling parameters. Safe by default: loopback bind;
a JSON `video_path` is opened only inside `--allow-path` folders, with no symbolic link followed, and copied into
the job's folder, so the file checked is the file that runs (`entrypoints.confine`); uploads are streamed to disk
under a size cap; every resource a client can spend is bounded (`Limits`); with API keys each job belongs to the key
that made it; errors are JSON `{"error": {"message", "type", "param", "code"}}` with one line of message, never a
stack trace or a path of the server. Jobs, their queue and their worker processes are in `entrypoints.jobs`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from entrypoints.confine import PathRefused, open_confined, quote, scrub_paths
from entrypoints.jobs import (
    ACTIVE,
    CANCELLED,
    COMPLETED,
    FINISHED,
    IN_PROGRESS,
    InputFile,
    InputQuotaFull,
    JobRunner,
    JobStore,
    KeyQueueFull,
    QueueFull,
    UploadsBusy,
    new_job_id,
    short_message,
)
from k6vsr_core.errors import BundleError, MediaError, ParameterError, StoreError, UserFacingError
from k6vsr_core.latent import check_latent_scale, parse_rate
from k6vsr_core.params import UpscaleParams, parse_params
from service.runs import ModelSpec, model_info, prepare_run
from storage import RunStore

log = logging.getLogger("k6vsr.server")

# SGLang request field -> UpscaleParams field.
FIELDS = {
    "sr_resolution_scale": "scale",
    "sr_tiles_batch_size": "tiles_batch_size",
    "sr_tile_min_overlap": "min_overlap",
    "sr_target_resolution": "target_resolution",
    "sr_target_resize_mode": "target_resize_mode",
    "seed": "seed",
    "num_inference_steps": "num_inference_steps",
    # Whole videos: absent fields mean every frame, so an SGLang client gets the whole video.
    "sr_frames": "frames",
    "max_frames": "max_frames",
    "sr_window_overlap": "window_overlap",
    # Output controls, as the command line's --codec, --crf, --preset, --pix-fmt, --audio and --fps.
    "codec": "codec",
    "crf": "crf",
    "preset": "preset",
    "pix_fmt": "pix_fmt",
    "audio": "audio",
    "fps_mode": "fps_mode",
}
# A client names no file of the server's: `audio` takes the modes only, not a path.
HTTP_AUDIO_MODES = ("contract", "original", "none")
# Sent by OpenAI-style clients; meaningless for super-resolution, so accepted and ignored.
IGNORED_FIELDS = ("model", "prompt")
FILE_FIELD = "video_reference"
# Instead of a clip: one unscaled KVAE latent [T, C, H, W] (a safetensors file), played at the rate of `RATE_FIELD`.
LATENT_FIELD = "latent_reference"
RATE_FIELD = "fps"
FILE_FIELDS = (FILE_FIELD, LATENT_FIELD)
MAX_PART_HEADER_BYTES = 16 << 10
RETRY_AFTER_S = 30
# The folder of the store that holds the service's own Prefect server (`flows.prefect_server`).
PREFECT_HOME = "prefect-server"
# At most this many of a request's field problems are spelled out in one message.
PROBLEMS_SHOWN = 3


@dataclass(frozen=True)
class Limits:
    """What one request, and all of them together, may make the server spend. Each is a `serve` option, whose
    default is set there."""

    max_upload_bytes: int  # --max-upload-mb: the clip of one upload
    max_fields: int  # --max-fields: fields of one request besides the clip
    max_fields_bytes: int  # --max-fields-kb: all of a request but the clip (a JSON body, form fields)
    max_queued: int  # --max-queued: jobs waiting for a worker
    input_quota_bytes: int  # --input-quota-mb: inputs on disk of queued and running jobs
    max_output_pixels: int  # --max-output-mpx: frames x width x height of one job's result
    retention_s: float  # --retention-hours: finished jobs are deleted this long after they finished
    max_tiles: int = 2048  # --max-tiles: tile tasks of one job (tiles of a window x windows)
    max_windows: int = 512  # --max-windows: windows of one job
    upload_timeout_s: float = 900.0  # --upload-timeout-s: a request body must arrive within this time, else 408
    uploads_per_key: int | None = None  # --max-uploads-per-key: request bodies one key sends at once (None: any)
    queued_per_key: int | None = None  # --max-queued-per-key: queue places one key holds (None: all)
    finished_quota_bytes: int | None = None  # --finished-quota-mb: disk finished jobs may keep (None: no budget)

    @property
    def max_request_bytes(self) -> int:
        return self.max_upload_bytes + self.max_fields_bytes


@dataclass(frozen=True)
class ServerConfig:
    store_root: Path  # the server's own folder: job records, inputs, outputs, its Prefect home; the runs too by default
    limits: Limits
    allow_paths: tuple[Path, ...] = ()
    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()  # keys that see, read and delete every job
    list_jobs: bool = False  # without keys: whether GET /v1/videos lists the jobs
    umask: int = 0o077
    workers: int = 1
    model_name: str = ""
    run_root: str | Path | None = None  # where the runs live when not in store_root (e.g. an object-store URL)

    @property
    def runs(self) -> str | Path:
        return self.run_root or self.store_root


# ----------------------------------------------------------------------------------------------- errors


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
    415: "invalid_request_error",
    422: "invalid_request_error",
    408: "invalid_request_error",
    429: "rate_limit_error",
}
_CODE = {404: "not_found", 405: "method_not_allowed"}

# The errors a user can fix (k6vsr_core.errors) as HTTP answers: the first class that matches gives status and code.
USER_ERROR_STATUS: tuple[tuple[type[UserFacingError], int, str], ...] = (
    (MediaError, 400, "invalid_video"),
    (ParameterError, 400, "invalid_value"),
    (BundleError, 503, "model_unavailable"),
    (StoreError, 500, "store_unusable"),
    (UserFacingError, 400, "invalid_request"),
)


def api_error(err: UserFacingError, param: str | None = None, message: str | None = None) -> ApiError:
    """The HTTP answer to an error a user can fix: its status and code from `USER_ERROR_STATUS`."""
    status, code = next((status, code) for kind, status, code in USER_ERROR_STATUS if isinstance(err, kind))
    return ApiError(status, message or str(err), param=param, code=code)


def error_response(
    status: int,
    message: str,
    kind: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {
        "error": {
            "message": short_message(message),
            "type": kind or _KIND.get(status, "server_error"),
            "param": param,
            "code": code or _CODE.get(status, "http_error"),
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    retry = {"Retry-After": str(RETRY_AFTER_S)}

    @app.exception_handler(ApiError)
    async def api_error_handler(_: Request, err: ApiError) -> JSONResponse:
        return error_response(err.status, err.message, err.kind, err.param, err.code, err.headers)

    @app.exception_handler(UserFacingError)
    async def user_error_handler(_: Request, err: UserFacingError) -> JSONResponse:
        answer = api_error(err)
        return error_response(answer.status, answer.message, param=answer.param, code=answer.code)

    @app.exception_handler(PathRefused)
    async def path_refused(_: Request, err: PathRefused) -> JSONResponse:
        return error_response(403 if err.forbidden else 400, err.message, param="video_path", code=err.code)

    @app.exception_handler(QueueFull)
    async def queue_full(_: Request, err: QueueFull) -> JSONResponse:
        return error_response(
            429,
            f"the queue is full ({err.limit} jobs waiting, --max-queued); retry later",
            code="queue_full",
            headers=retry,
        )

    @app.exception_handler(KeyQueueFull)
    async def key_queue_full(_: Request, err: KeyQueueFull) -> JSONResponse:
        return error_response(
            429,
            f"this key already has {err.limit} jobs queued or being sent (--max-queued-per-key); retry once one runs",
            code="key_queue_full",
            headers=retry,
        )

    @app.exception_handler(UploadsBusy)
    async def uploads_busy(_: Request, err: UploadsBusy) -> JSONResponse:
        return error_response(
            429,
            f"this key is already sending {err.limit} request(s) (--max-uploads-per-key); retry once one is done",
            code="too_many_uploads",
            headers=retry,
        )

    @app.exception_handler(InputQuotaFull)
    async def quota_full(_: Request, err: InputQuotaFull) -> JSONResponse:
        return error_response(
            429,
            f"the inputs of queued and running jobs fill the input storage quota ({err.limit} "
            "bytes, --input-quota-mb); retry later",
            code="input_quota_full",
            headers=retry,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail), headers=getattr(err, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def disconnected(_: Request, err: ClientDisconnect) -> JSONResponse:
        return error_response(
            400, "the client disconnected before the request body was complete", code="client_disconnected"
        )

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> JSONResponse:
        log.error("internal error: %s: %s", type(err).__name__, err, exc_info=err)
        return error_response(500, "internal server error; see the server log", "server_error", code="internal_error")


# ----------------------------------------------------------------------------------------------- callers


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the id of its key (never the key), or None on a server without keys, where every client
    is the same one. An admin sees every job."""

    owner: str | None
    admin: bool = False

    def sees(self, job: dict[str, Any]) -> bool:
        return self.admin or self.owns(job)

    def owns(self, job: dict[str, Any]) -> bool:
        return job.get("owner") == self.owner


ANONYMOUS = Caller(owner=None)


def key_owner(key: str) -> str:
    return "key_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def caller_of(request: Request) -> Caller:
    return getattr(request.state, "caller", ANONYMOUS)


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
                    401,
                    f"{message}: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["caller"] = found
        await self.app(scope, receive, send)


# ----------------------------------------------------------------------------------------------- request fields


def params_from_fields(fields: dict[str, Any]) -> UpscaleParams:
    """SGLang fields -> UpscaleParams; every bad value is reported with its SGLang field name."""
    values: dict[str, Any] = {}
    problems: list[tuple[str, str, str]] = []  # (field, message, code)
    for name, value in fields.items():
        if name in IGNORED_FIELDS:
            continue
        internal = FIELDS.get(name)
        if internal is None:
            allowed = ", ".join(["video_path", *FILE_FIELDS, RATE_FIELD, *FIELDS])
            problems.append((name, f"unknown field {quote(name)}; allowed: {allowed}", "unknown_field"))
            continue
        if isinstance(value, bool) or isinstance(value, (list, dict)):
            problems.append((name, f"{name}={quote(str(value))} has the wrong type", "invalid_value"))
            continue
        if name == "audio" and value not in HTTP_AUDIO_MODES:
            allowed = ", ".join(HTTP_AUDIO_MODES)
            problems.append((name, f"audio={quote(str(value))} is not known; allowed: {allowed}", "invalid_value"))
            continue
        try:
            parse_params(**{internal: value})
        except ParameterError as err:
            text = " ".join(str(err).split())
            text = name + text[len(internal) :] if text.startswith(internal) else f"{name}: {text}"
            problems.append((name, text, "invalid_value"))
            continue
        values[internal] = value
    if problems:
        shown = "; ".join(message for _, message, _ in problems[:PROBLEMS_SHOWN])
        more = f" (and {len(problems) - PROBLEMS_SHOWN} more)" if len(problems) > PROBLEMS_SHOWN else ""
        raise ApiError(400, shown + more, param=problems[0][0][:64], code=problems[0][2])
    try:
        return parse_params(**values)
    except ParameterError as err:
        raise ApiError(400, str(err), code="invalid_value") from None


def api_params(params: dict[str, Any]) -> dict[str, Any]:
    """A job's parameters under their SGLang names."""
    return {api: params.get(internal) for api, internal in FIELDS.items()}


# ----------------------------------------------------------------------------------------------- request bodies


def _too_many_fields(limits: Limits) -> ApiError:
    return ApiError(
        413,
        f"the request has more than {limits.max_fields} fields besides the clip (--max-fields)",
        code="too_many_fields",
    )


def _fields_too_large(limits: Limits) -> ApiError:
    return ApiError(
        413,
        f"the request takes more than {limits.max_fields_bytes} bytes besides the clip (--max-fields-kb)",
        code="fields_too_large",
    )


def _declared_length(request: Request) -> int | None:
    length = request.headers.get("content-length", "")
    return int(length) if length.isdigit() else None


class UploadTimeout(ApiError):
    def __init__(self, limit_s: float) -> None:
        super().__init__(
            408,
            f"the request body did not arrive within {limit_s:g} s (--upload-timeout-s)",
            code="request_timeout",
            headers={"Connection": "close"},  # the rest of the body is never read
        )


async def body_chunks(request: Request, limits: Limits) -> AsyncIterator[bytes]:
    """The request body as it arrives, all of it within `upload_timeout_s`: a client that trickles or stalls gives
    back its admission slot and its quota at the deadline. (Neither uvicorn nor Starlette bounds a body's time.)"""
    deadline = asyncio.get_running_loop().time() + limits.upload_timeout_s
    chunks = request.stream()
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                chunk = await anext(chunks)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise UploadTimeout(limits.upload_timeout_s) from None
        yield chunk


async def read_json(request: Request, limits: Limits) -> dict[str, Any]:
    length = _declared_length(request)
    if length is not None and length > limits.max_fields_bytes:
        raise _fields_too_large(limits)
    body = bytearray()
    async for chunk in body_chunks(request, limits):
        body += chunk
        if len(body) > limits.max_fields_bytes:
            raise _fields_too_large(limits)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: arrays nested deeper than the parser goes
        raise ApiError(400, "request body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    extra = data.pop("extra_body", None)  # as SGLang's server: OpenAI clients may nest fields here
    if isinstance(extra, dict):
        data.update(extra)
    if len(data) > limits.max_fields + 1:  # + video_path
        raise _too_many_fields(limits)
    return data


class FormError(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(400, f"malformed multipart body: {message}", code="malformed_form")


class UploadTooLarge(ApiError):
    def __init__(self, limit: int, field: str = FILE_FIELD) -> None:
        super().__init__(
            413,
            f"{field} is larger than the upload limit of {limit} bytes (--max-upload-mb)",
            param=field,
            code="file_too_large",
        )


@dataclass(frozen=True)
class FormBody:
    fields: dict[str, str]  # every field but the file, as text
    file_field: str  # the file's field: `video_reference` (a clip) or `latent_reference` (a latent)


class _FormReceiver:
    """python-multipart's streaming callbacks: the file (`video_reference`, or `latent_reference`) goes straight to
    the job's input (stopping as soon as it passes the cap or the quota), other fields are kept as strings,
    `max_fields` of them at most. The client's file name is never used."""

    def __init__(self, open_input: Callable[[str], InputFile], limits: Limits) -> None:
        self.open_input = open_input
        self.limits = limits
        self.fields: dict[str, str] = {}
        self.file_bytes = 0
        self.ended = False
        self._header: list[bytes] = [b"", b""]
        self._disposition = b""
        self._name = ""
        self._value = bytearray()
        self._input: InputFile | None = None
        self.file_field: str | None = None  # the file field received, once it is complete

    def callbacks(self) -> dict[str, Callable[..., None]]:
        return {
            "on_part_begin": self._begin,
            "on_header_field": lambda data, start, end: self._add_header(0, data[start:end]),
            "on_header_value": lambda data, start, end: self._add_header(1, data[start:end]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": lambda data, start, end: self._data(bytes(data[start:end])),
            "on_part_end": self._part_end,
            "on_end": self._end,
        }

    def _begin(self) -> None:
        self._header, self._disposition, self._value = [b"", b""], b"", bytearray()

    def _add_header(self, which: int, data: bytes) -> None:
        self._header[which] += data

    def _header_end(self) -> None:
        if self._header[0].strip().lower() == b"content-disposition":
            self._disposition = self._header[1].strip()
        self._header = [b"", b""]

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        name = options.get(b"name", b"").decode("latin-1")
        if not name:
            raise FormError("a part has no name")
        self._name = name
        if b"filename" in options or name in FILE_FIELDS:
            if name not in FILE_FIELDS:
                raise ApiError(
                    400,
                    f"unexpected file field {quote(name)}; send the clip as {FILE_FIELD!r} (or a latent as "
                    f"{LATENT_FIELD!r})",
                    param=name[:64],
                    code="unexpected_file_field",
                )
            if self.file_field == name:
                raise ApiError(400, f"{name} was sent twice", param=name, code="duplicate_field")
            if self.file_field is not None:
                raise ApiError(
                    400, f"send {FILE_FIELD} or {LATENT_FIELD}, not both", param=name, code="conflicting_inputs"
                )
            self._input = self.open_input(name)
        elif len(self.fields) >= self.limits.max_fields:
            raise _too_many_fields(self.limits)

    def _data(self, data: bytes) -> None:
        if self._input is not None:
            self._input.write(data)
            self.file_bytes += len(data)
        else:
            self._value += data
            if len(self._value) > self.limits.max_fields_bytes:
                raise _fields_too_large(self.limits)

    def _part_end(self) -> None:
        if self._input is not None:
            self._input.close()
            self._input = None
            self.file_field = self._name
            return
        if self._name in self.fields:
            raise ApiError(
                400, f"form field {quote(self._name)} was sent twice", param=self._name[:64], code="duplicate_field"
            )
        try:
            self.fields[self._name] = self._value.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(
                400, f"form field {quote(self._name)} is not UTF-8 text", param=self._name[:64], code="invalid_value"
            ) from None

    def _end(self) -> None:
        self.ended = True

    def close(self) -> None:
        if self._input is not None:
            self._input.close()


async def read_form(request: Request, open_input: Callable[[str], InputFile], limits: Limits) -> FormBody:
    """Stream a multipart body: the clip (or latent) into `open_input(field name)`, the other fields returned as
    strings. Everything but the file's bytes (boundaries, part headers, fields) counts toward `max_fields_bytes`."""
    length = _declared_length(request)
    if length is not None and length > limits.max_request_bytes:
        raise ApiError(
            413,
            f"the request is larger than {limits.max_request_bytes} bytes (--max-upload-mb plus --max-fields-kb)",
            code="request_too_large",
        )
    _, options = parse_options_header(request.headers["content-type"])
    boundary = options.get(b"boundary", b"")
    if not 1 <= len(boundary) <= 200:
        raise FormError("missing or invalid boundary in Content-Type")
    receiver = _FormReceiver(open_input, limits)
    parser = MultipartParser(boundary, receiver.callbacks(), max_header_size=MAX_PART_HEADER_BYTES)
    received = 0
    try:
        async for chunk in body_chunks(request, limits):
            received += len(chunk)
            parser.write(chunk)
            if received - receiver.file_bytes > limits.max_fields_bytes:
                raise _fields_too_large(limits)
            if receiver.ended:
                break  # the epilogue is not read
        parser.finalize()
    except MultipartParseError as err:
        raise FormError(f"{' '.join(str(err).split())[:200]}") from None
    finally:
        receiver.close()
    if not receiver.ended:
        raise FormError("the body ended before the closing boundary")
    if receiver.file_field is None:
        raise ApiError(
            400,
            f"the clip is missing: send it as the file field {FILE_FIELD!r} (or a latent as {LATENT_FIELD!r})",
            param=FILE_FIELD,
            code="missing_file",
        )
    return FormBody(receiver.fields, receiver.file_field)


def latent_rate(fields: dict[str, str]) -> str:
    """The rate of an uploaded latent (`fps`, taken out of `fields`), refused with its field before the latent is
    read: a missing or bad rate, a scale a latent cannot take, or `fps_mode`, which only a clip has."""
    if "fps_mode" in fields:
        raise ApiError(
            400,
            f"fps_mode is for a clip; a latent is played at its {RATE_FIELD}",
            param="fps_mode",
            code="conflicting_fields",
        )
    raw = fields.pop(RATE_FIELD, None)
    if raw is None:
        raise ApiError(
            400,
            f"{LATENT_FIELD} needs the form field {RATE_FIELD!r}: the latent's frame rate (e.g. 24 or 30000/1001)",
            param=RATE_FIELD,
            code="missing_fps",
        )
    try:
        rate = parse_rate(raw)
    except ParameterError as err:
        raise ApiError(400, str(err), param=RATE_FIELD, code="invalid_value") from None
    return str(rate)


def copy_path_source(raw: Any, roots: tuple[Path, ...], store: JobStore, job_id: str) -> str:
    """Copy the file `video_path` names, opened inside the allowed folders, into the job's input: the run reads that
    copy, never the path again. Returns the path relative to its allowed folder."""
    opened = open_confined(raw, roots)
    try:
        limit = store.quota.limit
        if opened.size > limit:
            raise ApiError(
                413,
                f"video_path {quote(opened.relative)} is larger than the input storage quota of "
                f"{limit} bytes (--input-quota-mb)",
                param="video_path",
                code="file_too_large",
            )
        too_large = lambda: ApiError(  # noqa: E731 - grown while being copied
            413,
            f"video_path {quote(opened.relative)} grew past the input storage quota while being copied",
            param="video_path",
            code="file_too_large",
        )
        target = store.open_input(job_id, cap=limit, too_large=too_large)
        try:
            while data := os.read(opened.fd, 1 << 20):
                target.write(data)
        except OSError as err:
            raise PathRefused(
                "path_unreadable",
                f"video_path {quote(opened.relative)} could not be read ({os.strerror(err.errno or 0)})",
            ) from None
        finally:
            target.close()
    finally:
        os.close(opened.fd)
    return opened.relative


# ----------------------------------------------------------------------------------------------- the app


def job_view(job: dict[str, Any], caller: Caller, store_root: str | Path, retention_s: float) -> dict[str, Any]:
    """The job as `caller` sees it: no server paths; a `video_path`, relative to its allowed folder, only to its
    owner."""
    progress = job.get("progress", 0)
    if job["status"] == IN_PROGRESS and job.get("tiles", {}).get("total"):
        decoded = RunStore(store_root, job["run_key"]).tiles_decoded()
        progress = min(99, int(100 * decoded / job["tiles"]["total"]))
    output = job["output"]
    source = {"type": job["source"]["type"]}
    if "video_path" in job["source"] and caller.owns(job):
        source["video_path"] = job["source"]["video_path"]
    finished_at = job.get("completed_at") if job["status"] in FINISHED else None
    return {
        "id": job["id"],
        "object": "video",
        "model": job["model"],
        "status": job["status"],
        "progress": progress,
        "created_at": job["created_at"],
        "started_at": job.get("started_at"),
        "completed_at": job.get("completed_at"),
        "expires_at": int(finished_at + retention_s) if finished_at is not None else None,
        "error": job.get("error"),
        "run_key": job["run_key"],
        "params": api_params(job["request"]),
        "size": f"{output['width']}x{output['height']}",
        "seconds": f"{output['frames'] / output['fps']:.3f}",
        "output": output,
        "tiles": job["tiles"],
        "source": source,
    }


def check_work(plan: Any, limits: Limits) -> None:
    """The work a job asks for, bounded before it is queued: frames x width x height of the model's result, its
    windows, and its tile tasks (a small clip declared huge makes a plan of tens of thousands of tiles)."""
    height, width = plan.sr_size
    pixels = plan.num_frames * height * width
    if pixels > limits.max_output_pixels:
        raise ApiError(
            400,
            f"this job would make {plan.num_frames} frame(s) of {width}x{height} ({pixels / 1e6:.1f} "
            f"megapixels); this server makes at most {limits.max_output_pixels / 1e6:g} megapixels a job "
            "(--max-output-mpx): lower sr_resolution_scale, set max_frames or send a smaller clip",
            param="sr_resolution_scale",
            code="output_too_large",
        )
    if plan.num_windows > limits.max_windows:
        raise ApiError(
            400,
            f"this job would run {plan.num_windows} windows of frames; this server runs at most "
            f"{limits.max_windows} a job (--max-windows): set max_frames or send a shorter clip",
            param="max_frames",
            code="too_many_windows",
        )
    tiles = plan.num_tiles * plan.num_windows
    if tiles > limits.max_tiles:
        raise ApiError(
            400,
            f"this job would run {tiles} tiles ({plan.num_tiles} a window x {plan.num_windows} window(s)); this "
            f"server runs at most {limits.max_tiles} a job (--max-tiles): lower sr_resolution_scale, set "
            "max_frames or send a smaller clip",
            param="sr_resolution_scale",
            code="too_many_tiles",
        )


@dataclass(frozen=True)
class Received:
    """A request read into its job's input: the parameters, the job's `source`, how messages name the input, and a
    latent's frame rate (None for a clip)."""

    params: UpscaleParams
    origin: dict[str, str]
    label: str
    latent_fps: str | None = None


def create_app(config: ServerConfig, spec: ModelSpec) -> FastAPI:
    limits = config.limits
    store = JobStore(config.store_root, limits.input_quota_bytes, config.run_root)
    runner = JobRunner(
        store,
        spec,
        workers=config.workers,
        max_queued=limits.max_queued,
        retention_s=limits.retention_s,
        uploads_per_key=limits.uploads_per_key,
        queued_per_key=limits.queued_per_key,
        finished_quota_bytes=limits.finished_quota_bytes,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        runner.start()
        try:
            yield
        finally:
            await run_in_threadpool(runner.stop)

    app = FastAPI(title="k6vsr", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.store, app.state.runner, app.state.config = store, runner, config
    _install_error_handlers(app)
    callers = {key: Caller(key_owner(key)) for key in config.api_keys}
    callers.update({key: Caller(key_owner(key), admin=True) for key in config.admin_keys})
    if callers:
        app.add_middleware(KeyAuth, callers=callers)

    def view(job: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return job_view(job, caller, config.runs, limits.retention_s)

    def find(job_id: str, caller: Caller) -> dict[str, Any]:
        job = store.get(job_id)
        if job is None or not caller.sees(job):  # another key's job is as unknown as a missing one
            raise ApiError(404, f"no video job {quote(job_id)}", param="video_id", code="job_not_found")
        return job

    def open_upload(job_id: str, field: str) -> InputFile:
        too_large = lambda: UploadTooLarge(limits.max_upload_bytes, field)  # noqa: E731
        return store.open_input(job_id, limits.max_upload_bytes, too_large)

    async def receive(request: Request, media_type: str, job_id: str) -> Received:
        """Read the request into the job's input (the streamed upload, or a copy of the confined `video_path`)."""
        if media_type == "multipart/form-data":
            form = await read_form(request, lambda field: open_upload(job_id, field), limits)
            if form.file_field == LATENT_FIELD:
                fields = dict(form.fields)
                rate = latent_rate(fields)
                params = params_from_fields(fields)
                try:
                    check_latent_scale(params)
                except ParameterError as err:
                    raise ApiError(400, str(err), param="sr_resolution_scale", code="invalid_value") from None
                return Received(params, {"type": "latent"}, LATENT_FIELD, rate)
            if RATE_FIELD in form.fields:
                raise ApiError(
                    400,
                    f"{RATE_FIELD} is the frame rate of a {LATENT_FIELD}; a clip takes fps_mode",
                    param=RATE_FIELD,
                    code="unexpected_field",
                )
            return Received(params_from_fields(form.fields), {"type": "upload"}, FILE_FIELD)
        fields = await read_json(request, limits)
        if LATENT_FIELD in fields:
            raise ApiError(
                400,
                f"{LATENT_FIELD} is a file: upload it as multipart/form-data with its {RATE_FIELD}",
                param=LATENT_FIELD,
                code="invalid_request",
            )
        raw_path = fields.pop("video_path", None)
        params = params_from_fields(fields)  # a bad field is refused before anything is copied
        relative = await run_in_threadpool(copy_path_source, raw_path, config.allow_paths, store, job_id)
        return Received(params, {"type": "path", "video_path": relative}, f"video_path {quote(relative)}")

    def prepare(job_id: str, received: Received) -> Any:
        label, params = received.label, received.params
        known = {str(store.input_path(job_id)): label, str(config.store_root): "<store>", str(config.runs): "<store>"}
        try:
            return prepare_run(store.input_path(job_id), params, spec, config.runs, received.latent_fps)
        except ParameterError as err:
            if received.latent_fps is None:
                raise
            # The latent's own checks (file, shape, dtype, channels, frames, values): the rate and scale were
            # checked with their fields.
            raise ApiError(400, scrub_paths(str(err), known), param=LATENT_FIELD, code="invalid_latent") from None
        except MediaError as err:
            param = FILE_FIELD if label == FILE_FIELD else "video_path"
            raise ApiError(
                400, f"{label}: {scrub_paths(err.cause, known)}", param=param, code="invalid_video"
            ) from None
        except ValueError as err:  # a plan these parameters cannot make (e.g. an `exact` target above the result)
            raise ApiError(
                400, f"this request cannot be planned: {scrub_paths(str(err), known)}", code="cannot_plan"
            ) from None

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": config.model_name}

    @app.post("/v1/videos")
    async def create_video(request: Request) -> JSONResponse:
        caller = caller_of(request)
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type not in ("multipart/form-data", "application/json", ""):
            raise ApiError(
                415,
                f"send JSON (application/json) with video_path, or multipart/form-data with the clip as {FILE_FIELD!r}",
                code="unsupported_media_type",
            )
        job_id = new_job_id()
        with runner.admission(caller.owner):
            try:
                received = await receive(request, media_type, job_id)
                params, origin = received.params, received.origin
                prepared = await run_in_threadpool(prepare, job_id, received)
                check_work(prepared.plan, limits)
                plan = prepared.plan
                job = await run_in_threadpool(
                    store.put,
                    {
                        "id": job_id,
                        "object": "video",
                        "model": config.model_name,
                        "owner": caller.owner,
                        "status": "queued",
                        "progress": 0,
                        "created_at": int(time.time()),
                        "created_ns": time.time_ns(),
                        "started_at": None,
                        "completed_at": None,
                        "error": None,
                        # The run is found by its key, its plan in the run's manifest: the record stays small.
                        "run_key": prepared.run.run_key,
                        "request": params.model_dump(mode="json"),
                        "latent_fps": received.latent_fps,
                        "source": origin,
                        "output": {
                            "width": plan.delivery_size[1],
                            "height": plan.delivery_size[0],
                            "frames": plan.num_frames,
                            "fps": plan.fps,
                            # A latent has no streams; an HTTP request names no audio file.
                            "has_audio": prepared.probe is not None and prepared.probe.has_audio,
                            "bytes": None,
                        },
                        "tiles": {"total": plan.num_tiles * plan.num_windows, "computed": None, "reused": None},
                    },
                )
            except BaseException:
                store.discard_dir(job_id)  # a partial or refused request leaves nothing behind
                raise
            runner.submit(job_id, caller.owner)
        log.info("job %s queued: run %s, %d tiles", job_id, prepared.run.run_key, plan.num_tiles)
        return JSONResponse(view(job, caller))

    # Plain functions: FastAPI runs them in its thread pool, so file reads and process signals never block the loop.
    @app.get("/v1/videos")
    def list_videos(request: Request) -> dict[str, Any]:
        caller = caller_of(request)
        if not callers and not config.list_jobs:
            raise ApiError(
                403,
                "listing jobs is off on this server: a job is read by its id (start the server with "
                "--list-jobs, or with API keys so that each key lists its own jobs)",
                code="listing_disabled",
            )
        # Only the caller's records are read (every one for an admin): a list costs what it lists.
        return {"object": "list", "data": [view(job, caller) for job in store.jobs(caller.owner, caller.admin)]}

    @app.get("/v1/videos/{video_id}")
    def get_video(request: Request, video_id: str) -> dict[str, Any]:
        caller = caller_of(request)
        return view(find(video_id, caller), caller)

    @app.get("/v1/videos/{video_id}/content")
    def get_content(request: Request, video_id: str) -> FileResponse:
        job = find(video_id, caller_of(request))
        if job["status"] != COMPLETED:
            hint = "poll GET /v1/videos/{id} until it is completed" if job["status"] in ACTIVE else "it has no output"
            raise ApiError(409, f"video job {video_id} is {job['status']}; {hint}", code=f"job_{job['status']}")
        output = store.output_path(video_id)
        if not output.is_file():
            raise ApiError(404, f"the output of video job {video_id} is gone from the store", code="output_gone")
        mkv = job.get("request", {}).get("codec") == "ffv1"
        media_type, suffix = ("video/x-matroska", ".mkv") if mkv else ("video/mp4", ".mp4")
        return FileResponse(output, media_type=media_type, filename=f"{video_id}{suffix}")

    @app.delete("/v1/videos/{video_id}")
    def delete_video(request: Request, video_id: str) -> dict[str, Any]:
        caller = caller_of(request)
        job = find(video_id, caller)
        if job["status"] in ACTIVE:
            job = runner.cancel(video_id) or job
            if job["status"] == CANCELLED:
                return view(job, caller)
        if runner.running(video_id):
            raise ApiError(
                409, f"video job {video_id} is still stopping; delete it again in a few seconds", code="job_stopping"
            )
        runner.delete(video_id)
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    return app


# ----------------------------------------------------------------------------------------------- serve


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _keys_in(files: list[str]) -> list[str]:
    """The keys of `--api-key-file` files: one a line; blank lines and `#` comments are skipped."""
    keys = []
    for name in files:
        try:
            lines = Path(name).expanduser().read_text().splitlines()
        except (OSError, UnicodeDecodeError) as err:
            reason = getattr(err, "strerror", None) or err
            raise ParameterError(f"--api-key-file {name}: cannot be read ({reason})") from None
        keys += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    return keys


def _at_least(value: float, minimum: float, flag: str) -> float:
    if value < minimum:
        raise ParameterError(f"{flag} must be at least {minimum:g}, not {value:g}")
    return value


def config_from(args: Any, store_root: Path, model_name: str, run_root: str | Path | None = None) -> ServerConfig:
    roots = []
    for raw in args.allow_path or []:
        root = Path(raw).expanduser().resolve()
        if not root.is_dir():
            raise ParameterError(f"--allow-path {raw}: not a directory")
        roots.append(root)
    env_key = os.environ.get("K6VSR_API_KEY")
    api_keys = [*(args.api_key or ([env_key] if env_key else [])), *_keys_in(args.api_key_file or [])]
    limits = Limits(
        max_upload_bytes=int(_at_least(args.max_upload_mb, 1, "--max-upload-mb")) << 20,
        max_fields=int(_at_least(args.max_fields, 1, "--max-fields")),
        max_fields_bytes=int(_at_least(args.max_fields_kb, 1, "--max-fields-kb")) << 10,
        max_queued=int(_at_least(args.max_queued, 1, "--max-queued")),
        input_quota_bytes=int(
            _at_least(args.input_quota_mb, args.max_upload_mb, "--input-quota-mb (at least --max-upload-mb)")
        )
        << 20,
        max_output_pixels=int(_at_least(args.max_output_mpx, 0.001, "--max-output-mpx") * 10**6),
        retention_s=_at_least(args.retention_hours, 0, "--retention-hours") * 3600.0,
        max_tiles=int(_at_least(args.max_tiles, 1, "--max-tiles")),
        max_windows=int(_at_least(args.max_windows, 1, "--max-windows")),
        upload_timeout_s=_at_least(args.upload_timeout_s, 0.1, "--upload-timeout-s"),
        uploads_per_key=int(_at_least(args.max_uploads_per_key, 1, "--max-uploads-per-key")),
        queued_per_key=int(_at_least(args.max_queued_per_key, 1, "--max-queued-per-key")),
        finished_quota_bytes=int(_at_least(args.finished_quota_mb, 0, "--finished-quota-mb")) << 20,
    )
    try:
        umask = int(args.umask, 8)
    except ValueError:
        raise ParameterError(f"--umask {args.umask!r} is not an octal mask such as 077 or 027") from None
    if not 0 <= umask <= 0o777:
        raise ParameterError(f"--umask {args.umask!r} is not an octal mask such as 077 or 027")
    return ServerConfig(
        store_root=Path(store_root),
        allow_paths=tuple(roots),
        api_keys=tuple(key for key in api_keys if key),
        admin_keys=tuple(args.admin_key or ()),
        list_jobs=bool(args.list_jobs),
        limits=limits,
        umask=umask,
        workers=max(1, int(getattr(args, "workers", 1) or 1)),
        model_name=model_name,
        run_root=run_root,
    )


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def serve(args: Any, spec: ModelSpec, store_root: Path, run_root: str | Path | None = None) -> None:
    """Run the server until interrupted, its jobs' files in `store_root` and their runs in `run_root` (default: the
    same folder). The model is checked before the port opens."""
    import uvicorn

    from flows.orchestrate import prefect_api

    if not log.handlers:  # our own handler: Prefect's logging setup reconfigures the root logger
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.DEBUG if args.debug else logging.INFO)
    info = model_info(spec)  # a missing or broken model fails here, with one clear line
    config = config_from(args, store_root, info.model_id, run_root)
    # Every file and folder this process and its children create: owner-only unless --umask shares them.
    os.umask(config.umask)
    if not _is_loopback(args.host) and not (config.api_keys or config.admin_keys):
        log.warning("listening on %s without --api-key: anyone who can reach it can submit jobs", args.host)
    # uvicorn re-raises SIGTERM after its graceful shutdown; with the default handler the process would die on the
    # spot, skipping the exit handlers that stop the job processes. Exit through Python instead.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    # Job processes report to one Prefect API: the configured one, else a server of this service's own, in the store,
    # on loopback behind an auth string that no HTTP client sees: the jobs' flow runs are no client's to read.
    with prefect_api(Path(store_root) / PREFECT_HOME, secured=True):
        uvicorn.run(
            create_app(config, spec),
            host=args.host,
            port=args.port,
            log_level="debug" if args.debug else "info",
            server_header=False,
        )
