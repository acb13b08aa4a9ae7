"""A run's log file: the lines its flow run and that flow run's tasks log, copied into the run's folder as they come.

Prefect sends the same lines to its API (the UI); the terminal shows only warnings unless asked for more. Lines that
tasks log in other processes (Dask workers) reach the UI, not this file.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect.logging.formatters import PrefectFormatter

RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


class _RunLogHandler(logging.FileHandler):
    """A line that cannot be written (the store's disk is full) is left out: the run's own error says why, where
    logging's default would print a traceback per line on the terminal."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        pass


@contextmanager
def run_log(path: Path, flow_run_id: str) -> Iterator[None]:
    """Append the lines of flow run `flow_run_id` and its tasks to `path` while the block runs."""
    handler = _RunLogHandler(path, encoding="utf-8")
    handler.setFormatter(
        PrefectFormatter(
            format="%(asctime)s | %(levelname)-7s | %(name)s - %(message)s",
            flow_run_fmt="%(asctime)s | %(levelname)-7s | Flow run %(flow_run_name)r - %(message)s",
            task_run_fmt="%(asctime)s | %(levelname)-7s | Task run %(task_run_name)r - %(message)s",
        )
    )
    # Several clips may run at once in one process (the archive): each file takes its own run's lines only.
    handler.addFilter(lambda record: getattr(record, "flow_run_id", None) == flow_run_id)
    loggers = [logging.getLogger(name) for name in RUN_LOGGERS]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        handler.close()
