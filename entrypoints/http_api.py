"""`k6vsr serve`: SGLang's video job API (`/v1/videos`) on top of the resumable clip flow.

    POST   /v1/videos                JSON {"video_path": ..., "sr_resolution_scale": ..., ...}, or multipart form data
                                     with the clip as file field `video_reference` and the same fields; -> job, queued
    GET    /v1/videos                every job, oldest first
    GET    /v1/videos/{id}           the job: status queued | in_progress | completed | failed | cancelled, progress
    GET    /v1/videos/{id}/content   the MP4 once completed (409 before, 404 for an unknown id)
    DELETE /v1/videos/{id}           cancels a queued or running job; removes a finished one and its files

Request fields and their defaults are SGLang's Kandinsky 6 SR sampling parameters. Safe by default: loopback bind,
JSON `video_path` only inside `--allow-path` folders (resolved, so `..` and symbolic links cannot escape), uploads
streamed to disk under a size cap and stored under the job id, a bearer key on every route with `--api-key`, random
job ids, and errors as JSON `{"error": {"message", "type", "param", "code"}}`, never a stack trace. Jobs, their queue
and their worker processes are in `entrypoints.jobs`.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from entrypoints.jobs import ACTIVE, CANCELLED, COMPLETED, IN_PROGRESS, JobRunner, JobStore, new_job_id
from flows.orchestrate import prefect_api
from k6vsr_core.errors import BundleError, MediaError, ParameterError, StoreError, UserFacingError
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
}
# Sent by OpenAI-style clients; meaningless for super-resolution, so accepted and ignored.
IGNORED_FIELDS = ("model", "prompt")
FILE_FIELD = "video_reference"
MAX_JSON_BYTES = 1 << 20
MAX_FORM_FIELD_BYTES = 64 << 10
MAX_PART_HEADER_BYTES = 16 << 10
FORM_OVERHEAD_BYTES = 1 << 20  # boundaries and small fields, on top of the file cap, for the Content-Length check


@dataclass(frozen=True)
class ServerConfig:
    store_root: Path
    allow_paths: tuple[Path, ...] = ()
    api_key: str | None = None
    max_upload_bytes: int = 2048 << 20
    workers: int = 1
    model_name: str = ""


# ----------------------------------------------------------------------------------------------- errors


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, kind: str | None = None, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


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


_KIND = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
         415: "invalid_request_error", 422: "invalid_request_error"}


def error_response(
    status: int, message: str, kind: str | None = None, param: str | None = None, code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind or _KIND.get(status, "server_error"), "param": param,
                      "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    def answer(err: ApiError) -> JSONResponse:
        return error_response(err.status, err.message, err.kind, err.param, err.code)

    @app.exception_handler(ApiError)
    async def api_error_handler(_: Request, err: ApiError) -> JSONResponse:
        return answer(err)

    @app.exception_handler(UserFacingError)
    async def user_error_handler(_: Request, err: UserFacingError) -> JSONResponse:
        return answer(api_error(err))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail), headers=getattr(err, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path"))
        return error_response(422, f"{where or 'request'}: {first.get('msg', 'invalid value')}", param=where or None)

    @app.exception_handler(ClientDisconnect)
    async def disconnected(_: Request, err: ClientDisconnect) -> JSONResponse:
        return error_response(400, "the client disconnected before the request body was complete")

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> JSONResponse:
        log.error("internal error: %s: %s", type(err).__name__, err, exc_info=err)
        return error_response(500, "internal server error; see the server log", "server_error")


class BearerAuth:
    """Every request needs `Authorization: Bearer <key>` (compared in constant time)."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)):
                message = "missing API key" if not header else "invalid API key"
                response = error_response(
                    401, f"{message}: send the header 'Authorization: Bearer <key>'", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ----------------------------------------------------------------------------------------------- request fields


def params_from_fields(fields: dict[str, Any]) -> UpscaleParams:
    """SGLang fields -> UpscaleParams; every bad value is reported with its SGLang field name."""
    values: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    for name, value in fields.items():
        if name in IGNORED_FIELDS:
            continue
        internal = FIELDS.get(name)
        if internal is None:
            allowed = ", ".join(["video_path", FILE_FIELD, *FIELDS])
            problems.append((name, f"unknown field {name!r}; allowed: {allowed}"))
            continue
        if isinstance(value, bool) or isinstance(value, (list, dict)):
            problems.append((name, f"{name}={value!r} has the wrong type"))
            continue
        try:
            parse_params(**{internal: value})
        except ParameterError as err:
            text = str(err)
            problems.append((name, name + text[len(internal):] if text.startswith(internal) else f"{name}: {text}"))
            continue
        values[internal] = value
    if problems:
        raise ApiError(400, "; ".join(message for _, message in problems), param=problems[0][0])
    try:
        return parse_params(**values)
    except ParameterError as err:
        raise ApiError(400, str(err)) from None


def api_params(params: dict[str, Any]) -> dict[str, Any]:
    """A job's parameters under their SGLang names."""
    return {api: params.get(internal) for api, internal in FIELDS.items()}


def resolve_video_path(raw: Any, roots: tuple[Path, ...]) -> Path:
    if not isinstance(raw, str) or not raw:
        raise ApiError(400, f"video_path must be a non-empty string (or upload the clip as multipart field "
                       f"{FILE_FIELD!r})", param="video_path")
    if not roots:
        raise ApiError(403, "video_path is not allowed on this server: start it with --allow-path DIR to accept "
                       f"clips under DIR, or upload the clip as {FILE_FIELD!r}", param="video_path")
    try:
        resolved = Path(raw).resolve()
    except (OSError, RuntimeError, ValueError):
        raise ApiError(400, "video_path is not a valid path", param="video_path") from None
    if not any(resolved.is_relative_to(root) for root in roots):
        raise ApiError(403, f"video_path {raw!r} is outside the folders this server allows", param="video_path")
    if not resolved.is_file():
        raise ApiError(400, f"video_path {raw!r} does not exist or is not a file", param="video_path")
    return resolved


# ----------------------------------------------------------------------------------------------- request bodies


async def read_json(request: Request) -> dict[str, Any]:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_JSON_BYTES:
            raise ApiError(413, f"JSON body is larger than {MAX_JSON_BYTES} bytes", code="body_too_large")
    try:
        data = json.loads(body)
    except ValueError:
        raise ApiError(400, "request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    extra = data.pop("extra_body", None)  # as SGLang's server: OpenAI clients may nest fields here
    if isinstance(extra, dict):
        data.update(extra)
    return data


class FormError(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(400, f"malformed multipart body: {message}")


class UploadTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"{FILE_FIELD} is larger than the upload limit of {limit} bytes (--max-upload-mb)",
                         param=FILE_FIELD, code="file_too_large")


def _capped(limit: int, error: Callable[[], ApiError], write: Callable[[bytes], Any]) -> Callable[[bytes], None]:
    seen = 0

    def sink(data: bytes) -> None:
        nonlocal seen
        seen += len(data)
        if seen > limit:
            raise error()
        write(data)

    return sink


class _FormReceiver:
    """python-multipart's streaming callbacks: the `video_reference` file goes straight to disk (stopping as soon as
    it passes the cap), other fields are kept as strings. The client's file name is never used."""

    def __init__(self, upload_to: Path, max_bytes: int) -> None:
        self.upload_to = upload_to
        self.max_bytes = max_bytes
        self.fields: dict[str, str] = {}
        self.has_file = False
        self.ended = False
        self._header: list[bytes] = [b"", b""]
        self._disposition = b""
        self._name = ""
        self._value = bytearray()
        self._file: Any = None
        self._sink: Callable[[bytes], None] = lambda _: None

    def callbacks(self) -> dict[str, Callable[..., None]]:
        return {
            "on_part_begin": self._begin,
            "on_header_field": lambda data, start, end: self._add_header(0, data[start:end]),
            "on_header_value": lambda data, start, end: self._add_header(1, data[start:end]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": lambda data, start, end: self._sink(bytes(data[start:end])),
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
        if b"filename" in options or name == FILE_FIELD:
            if name != FILE_FIELD:
                raise ApiError(400, f"unexpected file field {name!r}; send the clip as {FILE_FIELD!r}", param=name)
            if self.has_file:
                raise ApiError(400, f"{FILE_FIELD} was sent twice", param=FILE_FIELD)
            self.upload_to.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.upload_to.open("wb")
            self._sink = _capped(self.max_bytes, lambda: UploadTooLarge(self.max_bytes), self._file.write)
        else:
            self._sink = _capped(
                MAX_FORM_FIELD_BYTES, lambda: ApiError(413, f"form field {name!r} is too long", param=name),
                self._value.extend,
            )

    def _part_end(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self.has_file = True
            return
        if self._name in self.fields:
            raise ApiError(400, f"form field {self._name!r} was sent twice", param=self._name)
        try:
            self.fields[self._name] = self._value.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(400, f"form field {self._name!r} is not UTF-8 text", param=self._name) from None

    def _end(self) -> None:
        self.ended = True

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


async def read_form(request: Request, upload_to: Path, max_bytes: int) -> dict[str, str]:
    """Stream a multipart body: the clip to `upload_to`, the other fields returned as strings."""
    _, options = parse_options_header(request.headers["content-type"])
    boundary = options.get(b"boundary", b"")
    if not 1 <= len(boundary) <= 200:
        raise FormError("missing or invalid boundary in Content-Type")
    receiver = _FormReceiver(upload_to, max_bytes)
    parser = MultipartParser(boundary, receiver.callbacks(), max_header_size=MAX_PART_HEADER_BYTES)
    try:
        async for chunk in request.stream():
            parser.write(chunk)
            if receiver.ended:
                break  # the epilogue is not read
        parser.finalize()
    except MultipartParseError as err:
        raise FormError(f"malformed multipart body ({err})") from None
    finally:
        receiver.close()
    if not receiver.ended:
        raise FormError("the body ended before the closing boundary")
    if not receiver.has_file:
        raise ApiError(400, f"the clip is missing: send it as the file field {FILE_FIELD!r}", param=FILE_FIELD)
    return receiver.fields


# ----------------------------------------------------------------------------------------------- the app


def job_view(job: dict[str, Any], store_root: Path) -> dict[str, Any]:
    """The job as clients see it: no server paths except the caller's own `video_path`."""
    progress = job.get("progress", 0)
    if job["status"] == IN_PROGRESS and job.get("tiles", {}).get("total"):
        decoded = RunStore(store_root, job["run_key"]).tiles_decoded()
        progress = min(99, int(100 * decoded / job["tiles"]["total"]))
    output = job["output"]
    view = {
        "id": job["id"],
        "object": "video",
        "model": job["model"],
        "status": job["status"],
        "progress": progress,
        "created_at": job["created_at"],
        "started_at": job.get("started_at"),
        "completed_at": job.get("completed_at"),
        "error": job.get("error"),
        "run_key": job["run_key"],
        "params": api_params(job["request"]),
        "size": f"{output['width']}x{output['height']}",
        "seconds": f"{output['frames'] / output['fps']:.3f}",
        "output": output,
        "tiles": job["tiles"],
        "source": {key: value for key, value in job["source"].items() if key != "path"},
    }
    return view


def create_app(config: ServerConfig, spec: ModelSpec) -> FastAPI:
    store = JobStore(config.store_root)
    runner = JobRunner(store, spec, workers=config.workers)

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
    if config.api_key:
        app.add_middleware(BearerAuth, key=config.api_key)

    def find(job_id: str) -> dict[str, Any]:
        job = store.get(job_id)
        if job is None:
            raise ApiError(404, f"no video job {job_id!r}", param="video_id")
        return job

    def prepare(source: Path, params: UpscaleParams, label: str) -> Any:
        try:
            return prepare_run(source, params, spec, config.store_root)
        except MediaError as err:  # named as the client knows the clip, never by the server's path of an upload
            param = "video_path" if label != FILE_FIELD else FILE_FIELD
            raise api_error(err, param, f"{label}: {err.cause}") from None

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": config.model_name}

    @app.post("/v1/videos")
    async def create_video(request: Request) -> JSONResponse:
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        job_id = new_job_id()
        try:
            if media_type == "multipart/form-data":
                length = request.headers.get("content-length", "")
                if length.isdigit() and int(length) > config.max_upload_bytes + FORM_OVERHEAD_BYTES:
                    raise UploadTooLarge(config.max_upload_bytes)
                fields: dict[str, Any] = await read_form(request, store.input_path(job_id), config.max_upload_bytes)
                params = params_from_fields(fields)
                source, label, origin = store.input_path(job_id), FILE_FIELD, {"type": "upload"}
            elif media_type in ("application/json", ""):
                fields = await read_json(request)
                raw_path = fields.pop("video_path", None)
                params = params_from_fields(fields)
                source = resolve_video_path(raw_path, config.allow_paths)
                label, origin = raw_path, {"type": "path", "video_path": raw_path}
            else:
                raise ApiError(415, "send JSON (application/json) with video_path, or multipart/form-data with the "
                               f"clip as {FILE_FIELD!r}")
            prepared = await run_in_threadpool(prepare, source, params, label)
        except BaseException:
            store.discard_dir(job_id)  # a partial or refused upload leaves nothing behind
            raise
        plan = prepared.plan
        now = time.time()
        job = await run_in_threadpool(store.put, {
            "id": job_id,
            "object": "video",
            "model": config.model_name,
            "status": "queued",
            "progress": 0,
            "created_at": int(now),
            "created_ns": time.time_ns(),
            "started_at": None,
            "completed_at": None,
            "error": None,
            "run_key": prepared.run.run_key,
            "request": params.model_dump(mode="json"),
            "source": {**origin, "path": str(source)},
            "output": {
                "width": plan.delivery_size[1], "height": plan.delivery_size[0], "frames": plan.num_frames,
                "fps": plan.fps, "has_audio": prepared.probe.has_audio, "bytes": None,
            },
            "tiles": {"total": plan.num_tiles, "computed": None, "reused": None},
            "prepared": prepared.model_dump(mode="json"),  # the plan the job's flow runs; never shown to clients
        })
        runner.submit(job_id)
        log.info("job %s queued: run %s, %d tiles", job_id, prepared.run.run_key, plan.num_tiles)
        return JSONResponse(job_view(job, config.store_root))

    # Plain functions: FastAPI runs them in its thread pool, so file reads and process signals never block the loop.
    @app.get("/v1/videos")
    def list_videos() -> dict[str, Any]:
        return {"object": "list", "data": [job_view(job, config.store_root) for job in store.all()]}

    @app.get("/v1/videos/{video_id}")
    def get_video(video_id: str) -> dict[str, Any]:
        return job_view(find(video_id), config.store_root)

    @app.get("/v1/videos/{video_id}/content")
    def get_content(video_id: str) -> FileResponse:
        job = find(video_id)
        if job["status"] != COMPLETED:
            hint = "poll GET /v1/videos/{id} until it is completed" if job["status"] in ACTIVE else "it has no output"
            raise ApiError(409, f"video job {video_id} is {job['status']}; {hint}", code=f"job_{job['status']}")
        output = store.output_path(video_id)
        if not output.is_file():
            raise ApiError(404, f"the output of video job {video_id} is gone from the store")
        return FileResponse(output, media_type="video/mp4", filename=f"{video_id}.mp4")

    @app.delete("/v1/videos/{video_id}")
    def delete_video(video_id: str) -> dict[str, Any]:
        job = find(video_id)
        if job["status"] in ACTIVE:
            job = runner.cancel(video_id) or job
            if job["status"] == CANCELLED:
                return job_view(job, config.store_root)
        if runner.running(video_id):
            raise ApiError(409, f"video job {video_id} is still stopping; delete it again in a few seconds",
                           code="job_stopping")
        store.remove(video_id)
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


def server_config(
    store_root: Path, allow_paths: Sequence[str], api_key: str | None, max_upload_mb: int, workers: int, model_name: str
) -> ServerConfig:
    roots = []
    for raw in allow_paths:
        root = Path(raw).expanduser().resolve()
        if not root.is_dir():
            raise UserFacingError(f"--allow-path {raw}: not a directory")
        roots.append(root)
    if max_upload_mb < 1:
        raise UserFacingError("--max-upload-mb must be at least 1")
    return ServerConfig(
        store_root=Path(store_root),
        allow_paths=tuple(roots),
        api_key=api_key or None,
        max_upload_bytes=max_upload_mb << 20,
        workers=max(1, workers),
        model_name=model_name,
    )


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def serve(
    spec: ModelSpec,
    store_root: Path,
    host: str = "127.0.0.1",
    port: int = 30000,
    allow_paths: Sequence[str] = (),
    api_key: str | None = None,
    max_upload_mb: int = 2048,
    workers: int = 1,
    debug: bool = False,
) -> None:
    """Run the server until interrupted. The model is checked before the port opens."""
    import uvicorn

    if not log.handlers:  # our own handler: Prefect's logging setup reconfigures the root logger
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.DEBUG if debug else logging.INFO)
    info = model_info(spec)  # a missing or broken model fails here, with one clear line
    config = server_config(store_root, allow_paths, api_key, max_upload_mb, workers, info.model_id)
    if not _is_loopback(host) and not config.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach it can submit jobs", host)
    # uvicorn re-raises SIGTERM after its graceful shutdown; with the default handler the process would die on the
    # spot, skipping the exit handlers that stop a temporary Prefect server. Exit through Python instead.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    # Job processes report to one Prefect API: the configured one, else a temporary server for our lifetime.
    with prefect_api():
        uvicorn.run(
            create_app(config, spec), host=host, port=port, log_level="debug" if debug else "info",
            server_header=False,
        )
