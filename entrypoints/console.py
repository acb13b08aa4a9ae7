"""What the command line shows: a progress bar over a clip's tiles, warnings one line each, and a short summary.

The lines every task logs go to the Prefect UI and to the run's log file (`flows/run_log.py`), not to the terminal,
unless asked for with `--verbose`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm

from service.runs import PreparedRun
from storage import RunStore

# Prefect's terminal handler, set through the environment so that every process a command starts (Dask workers, job
# processes) inherits it; the API handler, which feeds the UI, keeps every line.
CONSOLE_LEVEL_ENV = "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"
# Prefect's client telemetry switch (it reads no setting of its own): off, so that a new user's first command shows
# its output, not Prefect's notice about usage data. Our server's analytics are off too (flows.prefect_server).
TELEMETRY_ENV = "DO_NOT_TRACK"


def configure_terminal(verbose: bool) -> None:
    """Warnings (one line each) and errors on the terminal; every log line too when `verbose`."""
    level = "INFO" if verbose else "WARNING"
    os.environ[CONSOLE_LEVEL_ENV] = level
    os.environ.setdefault(TELEMETRY_ENV, "1")
    if "prefect.logging.handlers" in sys.modules:  # Prefect already set up its logging here: tell its handlers too
        from prefect.logging.handlers import PrefectConsoleHandler

        loggers = [logging.getLogger(), *(logging.getLogger(name) for name in logging.root.manager.loggerDict)]
        for handler in {h for logger in loggers for h in logger.handlers if isinstance(h, PrefectConsoleHandler)}:
            handler.setLevel(level)
    if verbose:
        return
    warnings.showwarning = _show_once
    # Notes for developers, not users: torch's about its kernels, diffusers' about the configs' native key names.
    warnings.filterwarnings("ignore", message=".*flex attention.*")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    logging.getLogger("diffusers").setLevel(logging.ERROR)


_SHOWN: set[str] = set()


def _show_once(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    """One line per warning, each said once: planning before the run and ingest in it may see the same thing."""
    text = f"k6vsr: warning: {message}"
    if text not in _SHOWN:
        _SHOWN.add(text)
        print(text, file=sys.stderr)


@contextmanager
def tile_progress(prepared: PreparedRun, enabled: bool = True) -> Iterator[None]:
    """A bar over the run's decoded tiles, read from the store so it works with any task runner."""
    if not enabled or not sys.stderr.isatty():
        yield
        return
    store = RunStore(prepared.run.store_root, prepared.run.run_key)
    total = prepared.plan.num_tiles
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


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """Five lines: the output, the tiles, the time by stage, the run's folder and its log."""
    width, height = summary["size"]
    frames = summary["frames"]
    timings = summary["timings"]
    rate = summary.get("output_format", {}).get("frame_rate", summary["fps"])  # exact: 30000/1001 stays so
    return [
        f"wrote {summary['output']} ({width}x{height}, {frames} frame{'s' * (frames != 1)} at {rate} fps)",
        f"run {summary['run_key']}: {summary['tiles_computed']} of {summary['tiles_total']} tiles computed, "
        f"{summary['tiles_reused']} reused, {summary['dit_calls']} DiT calls"
        + ("; the output was already in the store" if summary["reused_output"] else ""),
        "seconds by stage: " + ", ".join(f"{stage} {seconds:.1f}" for stage, seconds in timings.items()),
        f"store: {summary['store']}",
        f"log: {summary['log']}",
    ]
