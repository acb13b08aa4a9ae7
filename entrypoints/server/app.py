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
the job's folder, so the file checked is the file that runs (`entrypoints.server.confine`); uploads are streamed to disk
under a size cap; every resource a client can spend is bounded (`Limits`: bodies, the queue, disk, host memory;
`Connections`: open connections and how long they may idle, `server.serving`); with API keys each job belongs to the key
that made it; errors are JSON `{"error": {"message", "type", "param", "code"}}` with one line of message, never a
stack trace or a path of the server. Jobs, their queue and their worker processes are in `entrypoints.server`
(`job_records`, `job_runner`, `worker_slots`, `child`).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from entrypoints.server.api_errors import ApiError, error_response, install_error_handlers
from entrypoints.server.auth import Caller, KeyAuth, key_owner, owners_of
from entrypoints.server.bodies import read_form
from entrypoints.server.config import Limits, ServerConfig, config_from
from entrypoints.server.framing import CloseAmbiguousFraming
from entrypoints.server.job_records import JobStore
from entrypoints.server.job_runner import JobRunner
from entrypoints.server.routes import Videos, router
from service.runs import ModelSpec, model_info

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

# The folder of the store that holds the service's own Prefect server (`runtime.prefect_server`).
PREFECT_HOME = "prefect-server"


# ----------------------------------------------------------------------------------------------- the app


def create_app(config: ServerConfig, spec: ModelSpec) -> FastAPI:
    limits = config.limits
    store = JobStore(config.store_root, limits.input_quota_bytes, config.run_root)
    runner = JobRunner(store, spec, config.workers, limits)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        runner.start()
        try:
            yield
        finally:
            await run_in_threadpool(runner.stop)

    app = FastAPI(title="k6vsr", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.videos = Videos(config, spec, store, runner, keyed=bool(config.api_keys or config.admin_keys))
    install_error_handlers(app)
    callers = {key: Caller(key_owner(key)) for key in config.api_keys}
    callers.update({key: Caller(key_owner(key), admin=True) for key in config.admin_keys})
    if callers:
        app.add_middleware(KeyAuth, callers=callers)
    app.add_middleware(CloseAmbiguousFraming)  # outermost: a 401 closes such a connection too
    app.include_router(router)
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


def prefect_ui_lines(api_url: str, home: Path | None, shown_by: str) -> list[str]:
    """Where the jobs' flow runs show: the UI of `PREFECT_API_URL` (`home` None), else of the server of the service's
    own in `home` (the command `shown_by` shows it again), whose login page asks for the auth string in its folder."""
    from runtime import prefect_server

    ui = prefect_server.ui_url(api_url)
    if home is None:
        return [f"the jobs' flow runs: Prefect UI at {ui} (PREFECT_API_URL)"]
    return [
        f"the jobs' flow runs: Prefect UI at {ui} (`{shown_by}` shows it again)",
        f"its login page asks for the auth string: paste the line of {prefect_server.auth_path(home)} (owner-only)",
    ]


def serve(args: Any, spec: ModelSpec, store_root: Path, run_root: str | Path | None = None) -> None:
    """Run the server until interrupted, its jobs' files in `store_root` and their runs in `run_root` (default: the
    same folder). The model is checked before the port opens."""
    from entrypoints.server.serving import BoundedServer, fit_connections, uvicorn_config
    from flows.orchestrate import prefect_api
    from runtime import prefect_server
    from runtime.prefect_api import configured_api_url

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
    bounds = fit_connections(config.connections)
    home = Path(store_root) / PREFECT_HOME
    # Read before the block, which points this process at that server (`PREFECT_API_URL`, `K6VSR_SERVER_HOME`).
    own_server = configured_api_url() is None
    shown_by = prefect_server.status_command(home)
    with prefect_api(home, secured=True) as api_url:
        for line in prefect_ui_lines(api_url, home if own_server else None, shown_by):
            log.info("%s", line)
        app = create_app(config, spec)
        owners = owners_of(config.api_keys + config.admin_keys)
        level = "debug" if args.debug else "info"
        BoundedServer(uvicorn_config(app, bounds, args.host, args.port, owners=owners, log_level=level)).run()
