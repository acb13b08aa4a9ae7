"""The Prefect API every command reports to: `PREFECT_API_URL` where it is configured, else the local server
(`runtime.prefect_server`, started on first use); on the way, flow runs whose process died are marked Crashed
(`runtime.flow_leases`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from runtime.api_loss import lost_api
from runtime.flow_leases import mark_crashed_runs
from runtime.prefect_server import HOME_ENV, server_auth, server_home, start_server

# Without it a Prefect client asks the server for a CSRF token on each new connection, one more request a clip run.
CSRF_SETTING = "PREFECT_CLIENT_CSRF_SUPPORT_ENABLED"


def configured_api_url() -> str | None:
    """`PREFECT_API_URL` from the environment or the active Prefect profile, if any."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


def ensure_server(home: Path | None = None, secured: bool = False) -> str:
    """The API URL every command reports to: `PREFECT_API_URL` if set, else the local server in `home` (started if
    absent; `secured`: behind an auth string, `api_auth(home)`).

    Flow runs whose process died without ending them are marked Crashed on the way.
    """
    url = configured_api_url() or start_server(home, secured)
    mark_crashed_runs(url, home)
    return url


def api_auth(home: Path | None = None) -> str | None:
    """The auth string `ensure_server(home)`'s API takes: None for a configured `PREFECT_API_URL` (its profile says
    what it needs), else the local server's, if secured."""
    return None if configured_api_url() else server_auth(home)


@contextlib.contextmanager
def prefect_api(home: Path | None = None, secured: bool = False) -> Iterator[str]:
    """Report to `ensure_server(home, secured)`'s API for the block; child processes (Dask workers, job processes)
    inherit it, its auth string and its home."""
    from prefect.settings import (
        PREFECT_API_AUTH_STRING,
        PREFECT_API_URL,
        PREFECT_CLIENT_CSRF_SUPPORT_ENABLED,
        PREFECT_SERVER_ANALYTICS_ENABLED,
        temporary_settings,
    )

    ours = configured_api_url() is None
    url = ensure_server(home, secured)
    auth = api_auth(home)
    exported = {"PREFECT_API_URL": url, **({"PREFECT_API_AUTH_STRING": auth} if auth else {})}
    if ours:  # the local server runs without CSRF protection (runtime.prefect_server)
        exported[CSRF_SETTING] = "false"
    if home is not None:  # flow runs hold their leases beside the server they report to
        exported[HOME_ENV] = str(home)
    saved = {name: os.environ.get(name) for name in exported}
    os.environ.update(exported)
    updates = {PREFECT_API_URL: url, PREFECT_SERVER_ANALYTICS_ENABLED: False}
    if ours:
        updates[PREFECT_CLIENT_CSRF_SUPPORT_ENABLED] = False
    if auth:
        updates[PREFECT_API_AUTH_STRING] = auth
    try:
        with temporary_settings(updates=updates):
            try:
                yield url
            except Exception as err:
                lost = lost_api(err, url, server_home() if home is None else home) if ours else lost_api(err, url)
                if lost is None:
                    raise
                _quiet_prefect()
                raise lost from err
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _quiet_prefect() -> None:
    """The process ends with the lost API's one line. As it exits, Prefect's services would log below it the events
    and logs they could not send to the server that is gone: its loggers are turned off (its internal ones ignore
    `logging.disable`), and with them the stdlib's switch for errors in logging handlers, which its log worker
    honours. What the terminal's handlers still hold is written first, above the line."""
    for name in (None, "prefect"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler):  # not Prefect's API handler: it would wait on the server
                with contextlib.suppress(Exception):
                    handler.flush()
    logging.disable(logging.CRITICAL)
    logging.raiseExceptions = False
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and name.split(".")[0] == "prefect":
            logger.disabled = True
