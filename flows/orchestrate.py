"""Running a flow from the command line: the Prefect API it reports to, the task runner, a terminal progress bar.

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
from pathlib import Path
from typing import Any

from k6vsr_core.params import UpscaleParams
from service.runs import ModelSpec


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


@contextmanager
def tile_progress(store_root: str, run_key: str | None, total: int, enabled: bool) -> Iterator[None]:
    """A progress bar over decoded tiles, read from the store so it works with any task runner."""
    if not enabled or run_key is None or not sys.stderr.isatty():
        yield
        return
    from tqdm import tqdm

    from storage import RunStore

    store = RunStore(store_root, run_key)
    stop = threading.Event()
    bar = tqdm(total=total, desc="tiles", unit="tile", file=sys.stderr)

    def poll() -> None:
        while not stop.wait(0.5):
            bar.n = min(total, store.tiles_decoded())
            bar.refresh()

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        bar.n = min(total, store.tiles_decoded())
        bar.close()


def run_clip(
    source: str,
    output: str,
    params: UpscaleParams,
    model: ModelSpec,
    store_root: str,
    workers: int = 1,
    gpus: bool = False,
    dask_address: str | None = None,
    show_progress: bool = True,
) -> Any:
    from flows.runners import make_task_runner, uses_processes
    from flows.upscale_clip import upscale_clip
    from service.runs import prepare_run

    prepared = prepare_run(source, params, model, store_root)
    runner = make_task_runner(workers, dask_address, gpus)
    with prefect_api(uses_processes(workers, gpus, dask_address)), tile_progress(
        store_root, prepared.run.run_key, prepared.plan.num_tiles, show_progress
    ):
        return upscale_clip.with_options(task_runner=runner)(
            source=str(Path(source)), output=output, params=params, model=model, store_root=store_root
        )
