"""What a command is doing while no bar shows it yet: starting the local Prefect server, loading the model.

One line each, said as it happens through the `k6vsr.status` logger. The command line prints them on a terminal,
above the progress bar (`entrypoints.console`); anywhere else (a job process, a warm worker) they are log lines at
INFO like any other, seen only where INFO is.
"""

from __future__ import annotations

import logging

STATUS_LOGGER = "k6vsr.status"

_log = logging.getLogger(STATUS_LOGGER)


def say(message: str) -> None:
    """One line of what is happening now, e.g. `starting the local Prefect server`."""
    _log.info(message)
