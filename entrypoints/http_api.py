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

import ipaddress
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from starlette.concurrency import run_in_threadpool

from entrypoints.confine import quote, scrub_paths
from entrypoints.jobs import (
    ACTIVE,
    CANCELLED,
    COMPLETED,
    FINISHED,
    IN_PROGRESS,
    InputFile,
    JobRunner,
    JobStore,
    new_job_id,
)
from entrypoints.server.auth import Caller, KeyAuth, caller_of, key_owner
from entrypoints.server.bodies import UploadTooLarge, copy_path_source, read_form, read_json
from entrypoints.server.config import Limits, ServerConfig, config_from
from entrypoints.server.errors import ApiError, error_response, install_error_handlers
from entrypoints.server.fields import FILE_FIELD, LATENT_FIELD, RATE_FIELD, api_params, latent_rate, params_from_fields
from k6vsr_core.errors import MediaError, ParameterError
from k6vsr_core.latent import check_latent_scale
from k6vsr_core.params import UpscaleParams
from service.runs import ModelSpec, model_info, prepare_run
from storage import RunStore

# The names the server's callers and tests use, wherever each is defined.
__all__ = [
    "ApiError",
    "Limits",
    "ServerConfig",
    "config_from",
    "create_app",
    "error_response",
    "key_owner",
    "read_form",
    "serve",
]

log = logging.getLogger("k6vsr.server")

# The folder of the store that holds the service's own Prefect server (`flows.prefect_server`).
PREFECT_HOME = "prefect-server"


# ----------------------------------------------------------------------------------------------- the app


def job_view(job: dict[str, Any], caller: Caller, store_root: Path, retention_s: float) -> dict[str, Any]:
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
    store = JobStore(config.store_root, limits.input_quota_bytes)
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
    install_error_handlers(app)
    callers = {key: Caller(key_owner(key)) for key in config.api_keys}
    callers.update({key: Caller(key_owner(key), admin=True) for key in config.admin_keys})
    if callers:
        app.add_middleware(KeyAuth, callers=callers)

    def view(job: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return job_view(job, caller, config.store_root, limits.retention_s)

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
        known = {str(store.input_path(job_id)): label, str(config.store_root): "<store>"}
        try:
            return prepare_run(store.input_path(job_id), params, spec, config.store_root, received.latent_fps)
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


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def serve(args: Any, spec: ModelSpec, store_root: Path) -> None:
    """Run the server until interrupted. The model is checked before the port opens."""
    import uvicorn

    from flows.orchestrate import prefect_api

    if not log.handlers:  # our own handler: Prefect's logging setup reconfigures the root logger
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.DEBUG if args.debug else logging.INFO)
    info = model_info(spec)  # a missing or broken model fails here, with one clear line
    config = config_from(args, store_root, info.model_id)
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
