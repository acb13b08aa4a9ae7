"""Prefect's console handler as k6vsr's processes use it: a flow or task run's own lines stay out of the terminal.

They go to the Prefect UI and to the run's log file (`flows/run_log.py`); the terminal shows the command's own lines
(warnings, one line each, and a failure in one line naming the item and its cause), not Prefect's tracebacks of
every failed attempt. With `--verbose` (the handler's level is then INFO or lower) every line shows. Prefect builds
the handler from its logging settings (`entrypoints.console.configure_terminal` names this class), so the processes
a command starts (Dask workers, job processes) use it too.
"""

from __future__ import annotations

import logging

from prefect.logging.handlers import PrefectConsoleHandler

RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


class CommandConsoleHandler(PrefectConsoleHandler):
    def filter(self, record: logging.LogRecord) -> bool:
        if self.level > logging.INFO and record.name.startswith(RUN_LOGGERS):
            return False
        return super().filter(record)
