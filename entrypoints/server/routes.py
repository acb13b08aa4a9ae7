"""The `/v1/videos` routes, and what they share: a request read into its job, planned and bounded; jobs found and
shown to their callers."""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from entrypoints.server.api_errors import RETRY_AFTER_S, ApiError
from entrypoints.server.auth import Caller, caller_of
from entrypoints.server.bodies import UploadTooLarge, copy_path_source, read_form, read_json
from entrypoints.server.config import Limits, ServerConfig
from entrypoints.server.confine import quote, scrub_paths
from entrypoints.server.download import OpenedFileResponse
from entrypoints.server.error_table import user_answer
from entrypoints.server.fields import FILE_FIELD, LATENT_FIELD, RATE_FIELD, api_params, latent_rate, params_from_fields
from entrypoints.server.host_memory import computes_on_cpu, job_bytes
from entrypoints.server.job_records import (
    ACTIVE,
    CANCELLED,
    COMPLETED,
    FINISHED,
    IN_PROGRESS,
    QUEUED,
    InputFile,
    JobOutput,
    JobRecord,
    JobSource,
    JobStore,
    JobTiles,
    new_job_id,
)
from entrypoints.server.job_runner import JobRunner
from k6vsr_core import media
from k6vsr_core.contract.latent import check_latent_scale
from k6vsr_core.contract.params import UpscaleParams
from k6vsr_core.errors import MediaError, ParameterError
from k6vsr_core.media.encoding import VideoEncoding
from service.runs import ModelSpec, prepare_run
from storage import RunRef

log = logging.getLogger("k6vsr.server")

# Jobs in one answer of GET /v1/videos, at most (and by default): the next page is `?after=<last_id>`.
PAGE_SIZE = 100


def job_view(job: JobRecord, caller: Caller, store_root: str | Path, retention_s: float) -> dict[str, Any]:
    """The job as `caller` sees it: no server paths; a `video_path`, relative to its allowed folder, only to its
    owner."""
    progress = job.progress
    if job.status == IN_PROGRESS and job.tiles.total:
        decoded = RunRef(store_root=str(store_root), run_key=job.run_key).open().tiles_decoded()
        progress = min(99, int(100 * decoded / job.tiles.total))
    output = job.output
    source: dict[str, str] = {"type": job.source.type}
    if job.source.video_path is not None and caller.owns(job):
        source["video_path"] = job.source.video_path
    finished_at = job.completed_at if job.status in FINISHED else None
    return {
        "id": job.id,
        "object": "video",
        "model": job.model,
        "status": job.status,
        "progress": progress,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "completed_at": job.completed_at,
        "expires_at": int(finished_at + retention_s) if finished_at is not None else None,
        "error": job.error.model_dump(mode="json") if job.error is not None else None,
        "run_key": job.run_key,
        "params": api_params(job.request),
        "size": f"{output.width}x{output.height}",
        "seconds": f"{output.frames / output.fps:.3f}",
        "output": output.answer(),
        "tiles": job.tiles.model_dump(mode="json"),
        "quality": job.quality,  # the output's quality report, once completed (docs/processing.md)
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


def check_memory(plan: Any, runner: JobRunner) -> None:
    """The host memory a job will hold, bounded before it is queued: it must fit the budget beside the server and
    every worker running a job of its own."""
    if runner.memory is None:
        return
    needed = job_bytes(plan, computes_on_cpu(runner.spec.device))
    room = runner.memory.job_room(len(runner.slots))
    if needed > room:
        height, width = plan.sr_size
        raise ApiError(
            400,
            f"this job would hold about {needed >> 20} MB of host memory ({plan.window_frames} frame(s) of "
            f"{width}x{height} a window, {plan.num_tiles} tiles); this server gives a job at most {max(0, room) >> 20}"
            " MB (--memory-budget-mb, less the server and its workers): lower sr_resolution_scale, set max_frames "
            "or send a smaller clip",
            param="sr_resolution_scale",
            code="memory_too_large",
        )


@dataclass(frozen=True)
class Received:
    """A request read into its job's input: the parameters, the job's `source`, how messages name the input, and a
    latent's frame rate (None for a clip)."""

    params: UpscaleParams
    origin: JobSource
    label: str
    latent_fps: str | None = None


@dataclass(frozen=True)
class Videos:
    """What the routes share: the server's configuration, its jobs and the runner of their worker processes."""

    config: ServerConfig
    spec: ModelSpec  # the model every job runs
    store: JobStore
    runner: JobRunner
    keyed: bool  # the server has API keys: each key lists its own jobs

    def view(self, job: JobRecord, caller: Caller) -> dict[str, Any]:
        return job_view(job, caller, self.config.runs, self.config.limits.retention_s)

    def find(self, job_id: str, caller: Caller) -> JobRecord:
        job = self.store.get(job_id)
        if job is None or not caller.sees(job):  # another key's job is as unknown as a missing one
            raise ApiError(404, f"no video job {quote(job_id)}", param="video_id", code="job_not_found")
        return job

    def open_upload(self, job_id: str, field: str) -> InputFile:
        too_large = lambda: UploadTooLarge(self.config.limits.max_upload_bytes, field)  # noqa: E731
        return self.store.open_input(job_id, self.config.limits.max_upload_bytes, too_large)

    async def receive(self, request: Request, media_type: str, job_id: str) -> Received:
        """Read the request into the job's input (the streamed upload, or a copy of the confined `video_path`)."""
        if media_type == "multipart/form-data":
            form = await read_form(request, lambda field: self.open_upload(job_id, field), self.config.limits)
            if form.file_field == LATENT_FIELD:
                fields = dict(form.fields)
                rate = latent_rate(fields)
                params = params_from_fields(fields)
                try:
                    check_latent_scale(params)
                except ParameterError as err:
                    raise ApiError(400, str(err), param="sr_resolution_scale", code="invalid_value") from None
                return Received(params, JobSource(type="latent"), LATENT_FIELD, rate)
            if RATE_FIELD in form.fields:
                raise ApiError(
                    400,
                    f"{RATE_FIELD} is the frame rate of a {LATENT_FIELD}; a clip takes fps_mode",
                    param=RATE_FIELD,
                    code="unexpected_field",
                )
            return Received(params_from_fields(form.fields), JobSource(type="upload"), FILE_FIELD)
        fields = await read_json(request, self.config.limits)
        if LATENT_FIELD in fields:
            raise ApiError(
                400,
                f"{LATENT_FIELD} is a file: upload it as multipart/form-data with its {RATE_FIELD}",
                param=LATENT_FIELD,
                code="invalid_request",
            )
        raw_path = fields.pop("video_path", None)
        params = params_from_fields(fields)  # a bad field is refused before anything is copied
        relative = await run_in_threadpool(copy_path_source, raw_path, self.config.allow_paths, self.store, job_id)
        return Received(params, JobSource(type="path", video_path=relative), f"video_path {quote(relative)}")

    def prepare(self, job_id: str, received: Received) -> Any:
        label, params = received.label, received.params
        known = {
            str(self.store.input_path(job_id)): label,
            str(self.config.store_root): "<store>",
            str(self.config.runs): "<store>",
        }
        try:
            return prepare_run(self.store.input_path(job_id), params, self.spec, self.config.runs, received.latent_fps)
        except ParameterError as err:
            if received.latent_fps is None:  # e.g. an `exact` target above the result: named after the input
                message = scrub_paths(str(err), {**known, f"{self.store.input_path(job_id)}: ": ""})
                raise ApiError(400, message, param=getattr(err, "param", None), code="invalid_value") from None
            # The latent's own checks (file, shape, dtype, channels, frames, values): the rate and scale were
            # checked with their fields.
            raise ApiError(400, scrub_paths(str(err), known), param=LATENT_FIELD, code="invalid_latent") from None
        except MediaError as err:  # `invalid_video`, or a subclass's own code (`unsupported_colour`)
            param = FILE_FIELD if label == FILE_FIELD else "video_path"
            status, code = user_answer(err)
            raise ApiError(status, f"{label}: {scrub_paths(err.cause, known)}", param=param, code=code) from None
        except ValueError as err:  # a plan these parameters cannot make (e.g. an `exact` target above the result)
            raise ApiError(
                400, f"this request cannot be planned: {scrub_paths(str(err), known)}", code="cannot_plan"
            ) from None


def videos_of(request: Request) -> Videos:
    return request.app.state.videos


router = APIRouter()


@router.get("/health")
def health(request: Request) -> dict[str, Any]:
    """`ok`, or `degraded` while the store's disk is full or a job worker is gone: the server answers, but new jobs
    would fail (still 200, so that a client reads why)."""
    videos = videos_of(request)
    workers = sum(slot.thread.is_alive() for slot in videos.runner.slots)
    disk = "full" if videos.store.disk.full else "ok"
    healthy = disk == "ok" and workers == len(videos.runner.slots)
    return {
        "status": "ok" if healthy else "degraded",
        "model": videos.config.model_name,
        "disk": disk,
        "workers": {"alive": workers, "total": len(videos.runner.slots)},
    }


@router.post("/v1/videos")
async def create_video(request: Request) -> JSONResponse:
    videos = videos_of(request)
    caller = caller_of(request)
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type not in ("multipart/form-data", "application/json", ""):
        raise ApiError(
            415,
            f"send JSON (application/json) with video_path, or multipart/form-data with the clip as {FILE_FIELD!r}",
            code="unsupported_media_type",
        )
    job_id = new_job_id()
    # Whose share of the admission slots and of the queue this request takes: its key's, or without keys its
    # client address's, so one anonymous client's stalled uploads do not lock out another.
    sharer = caller.owner if videos.keyed else f"address:{request.client.host if request.client else '?'}"
    with videos.runner.admission(sharer):
        try:
            received = await videos.receive(request, media_type, job_id)
            params, origin = received.params, received.origin
            prepared = await run_in_threadpool(videos.prepare, job_id, received)
            check_work(prepared.plan, videos.config.limits)
            check_memory(prepared.plan, videos.runner)
            plan = prepared.plan
            job = await run_in_threadpool(
                videos.store.put,
                JobRecord(
                    id=job_id,
                    object="video",
                    model=videos.config.model_name,
                    owner=caller.owner,
                    status=QUEUED,
                    progress=0,
                    created_at=int(time.time()),
                    created_ns=time.time_ns(),
                    started_at=None,
                    completed_at=None,
                    error=None,
                    run_key=prepared.run.run_key,
                    request=params.model_dump(mode="json"),
                    latent_fps=received.latent_fps,
                    source=origin,
                    output=JobOutput(
                        width=plan.delivery_size[1],
                        height=plan.delivery_size[0],
                        frames=plan.num_frames,
                        fps=plan.fps,
                        # A latent has no streams; an HTTP request names no audio file.
                        has_audio=prepared.probe is not None and prepared.probe.has_audio,
                        bytes=None,
                        sample_aspect=None if plan.sample_aspect is None else str(plan.sample_aspect),
                        colour=None if plan.colour == media.BT709_TV else plan.colour.describe(),
                        pixel_depth=16 if plan.depth == 16 else None,
                        hdr_metadata=None if plan.hdr is None else plan.hdr.describe(),
                    ),
                    tiles=JobTiles(total=plan.num_tiles * plan.num_windows, computed=None, reused=None),
                ),
            )
        except BaseException:
            videos.store.discard_dir(job_id)  # a partial or refused request leaves nothing behind
            raise
        videos.runner.submit(job_id, sharer)
    log.info("job %s queued: run %s, %d tiles", job_id, prepared.run.run_key, plan.num_tiles)
    return JSONResponse(videos.view(job, caller))


# Plain functions: FastAPI runs them in its thread pool, so file reads and process signals never block the loop.
@router.get("/v1/videos")
def list_videos(request: Request, limit: str = str(PAGE_SIZE), after: str | None = None) -> dict[str, Any]:
    """The caller's jobs, oldest first, a page at a time: at most `limit` of them, those after job `after`."""
    videos = videos_of(request)
    caller = caller_of(request)
    if not videos.keyed and not videos.config.list_jobs:
        raise ApiError(
            403,
            "listing jobs is off on this server: a job is read by its id (start the server with "
            "--list-jobs, or with API keys so that each key lists its own jobs)",
            code="listing_disabled",
        )
    if not (limit.isascii() and limit.isdigit() and 1 <= int(limit) <= PAGE_SIZE):
        raise ApiError(400, f"limit must be a whole number from 1 to {PAGE_SIZE}", param="limit", code="invalid_value")
    entries = videos.store.entries(caller.owner, caller.admin)
    start = 0
    if after is not None:
        start = next((index + 1 for index, entry in enumerate(entries) if entry.id == after), -1)
        if start < 0:
            raise ApiError(404, f"no video job {quote(after)} to list after", param="after", code="job_not_found")
    page = entries[start : start + int(limit)]
    # Only the page's records are read: a list costs what it lists.
    data = [videos.view(job, caller) for job in (videos.store.get(entry.id) for entry in page) if job is not None]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + len(page) < len(entries),
    }


@router.get("/v1/videos/{video_id}")
def get_video(request: Request, video_id: str) -> dict[str, Any]:
    videos = videos_of(request)
    caller = caller_of(request)
    return videos.view(videos.find(video_id, caller), caller)


@router.get("/v1/videos/{video_id}/content")
def get_content(request: Request, video_id: str) -> OpenedFileResponse:
    videos = videos_of(request)
    job = videos.find(video_id, caller_of(request))
    if job.status != COMPLETED:
        hint = "poll GET /v1/videos/{id} until it is completed" if job.status in ACTIVE else "it has no output"
        raise ApiError(409, f"video job {video_id} is {job.status}; {hint}", code=f"job_{job.status}")
    try:
        # Opened here, before the answer starts: a job deleted while it downloads keeps its bytes for this answer.
        output = videos.store.output_path(video_id).open("rb")
    except OSError as err:
        if err.errno in (errno.EMFILE, errno.ENFILE):  # the output is there: this server has no descriptor for it
            raise ApiError(
                503,
                "the server has no file descriptor free to send the output; retry shortly",
                code="server_busy",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        raise ApiError(404, f"the output of video job {video_id} is gone from the store", code="output_gone") from None
    encoding = VideoEncoding(codec=job.request.get("codec") or "h264")
    return OpenedFileResponse(output, media_type=encoding.media_type, filename=f"{video_id}{encoding.suffix}")


@router.delete("/v1/videos/{video_id}")
def delete_video(request: Request, video_id: str) -> dict[str, Any]:
    videos = videos_of(request)
    caller = caller_of(request)
    job = videos.find(video_id, caller)
    if job.status in ACTIVE:
        job = videos.runner.cancel(video_id) or job
        if job.status == CANCELLED:
            return videos.view(job, caller)
    if videos.runner.running(video_id):
        raise ApiError(
            409, f"video job {video_id} is still stopping; delete it again in a few seconds", code="job_stopping"
        )
    if not videos.runner.delete(video_id):  # another request deleted it meanwhile
        raise ApiError(404, f"no video job {quote(video_id)}", param="video_id", code="job_not_found")
    return {"id": video_id, "object": "video.deleted", "deleted": True}
