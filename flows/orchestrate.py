"""Running a flow from an entry point: the Prefect API it reports to and the task runner.

Without `PREFECT_API_URL`, Prefect starts a temporary local server in this process. Dask worker processes would
each start their own (slow, and they can be orphaned when a worker dies), so for process-based runners we start the
temporary server ourselves and hand its address to every worker through the environment.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from flows.runners import make_task_runner, uses_processes
from flows.upscale_clip import ClipSummary, upscale_clip
from service.runs import ModelSpec, PreparedRun


@contextmanager
def prefect_api(for_processes: bool) -> Iterator[None]:
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ANALYTICS_ENABLED, temporary_settings

    if os.environ.get("PREFECT_API_URL") or PREFECT_API_URL.value() or not for_processes:
        yield
        return
    from prefect.server.api.server import SubprocessASGIServer

    # Offline machines are common here: the server's usage telemetry would only log connection errors.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

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
    with prefect_api(uses_processes(workers, gpus, dask_address)):
        return upscale_clip.with_options(task_runner=runner)(
            source=prepared.source,
            output=output,
            params=prepared.plan.params,
            model=model,
            store_root=prepared.run.store_root,
            prepared=prepared,
        )
