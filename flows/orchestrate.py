"""Running a flow from an entry point: the Prefect API it reports to and the task runner.

Without `PREFECT_API_URL`, we start one temporary local Prefect server for the process and hand its address to every
process it starts through the environment: Dask workers would otherwise each start their own (slow, and orphaned
when a worker dies). Its usage analytics are off: on an offline machine they would only log connection errors.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from flows.runners import make_task_runner
from flows.upscale_clip import ClipSummary, upscale_clip
from service.runs import ModelSpec, PreparedRun


@contextmanager
def prefect_api() -> Iterator[None]:
    """The configured Prefect API, else a temporary server (analytics off) for as long as this process runs."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ANALYTICS_ENABLED, temporary_settings

    if os.environ.get("PREFECT_API_URL") or PREFECT_API_URL.value():
        yield
        return
    from prefect.server.api.server import SubprocessASGIServer

    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"  # the server process reads its settings from here
    server = SubprocessASGIServer()
    server.start()
    # Python's atexit (which stops the server) does not run on a default SIGTERM: exit through Python instead.
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.environ["PREFECT_API_URL"] = server.api_url
    # The server stops when this process exits, after Prefect has flushed its logs to it.
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url, PREFECT_SERVER_ANALYTICS_ENABLED: False}):
            yield
    finally:
        os.environ.pop("PREFECT_API_URL", None)


def run_clip(
    prepared: PreparedRun,
    output: str,
    model: ModelSpec,
    workers: int = 1,
    gpus: bool = False,
    dask_address: str | None = None,
) -> ClipSummary:
    """Run the clip flow on the plan `prepared`, its tiles on threads or Dask workers, reporting to one Prefect API."""
    runner = make_task_runner(workers, dask_address, gpus)
    with prefect_api():
        return upscale_clip.with_options(task_runner=runner)(
            source=prepared.source,
            output=output,
            params=prepared.plan.params,
            model=model,
            store_root=prepared.run.store_root,
            prepared=prepared,
        )
