"""A Prefect API that stops answering mid-archive: the UI's best-effort updates stop paying the client's retries each,
and the archive stops at the first clip that found the API gone rather than fail every clip after it."""

from __future__ import annotations

import uuid

import httpx
import pytest

API = "http://127.0.0.1:4321/api"


@pytest.fixture
def api_url() -> object:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: API}):
        yield API


def _refused(url: str) -> httpx.ConnectError:
    return httpx.ConnectError("[Errno 111] Connection refused", request=httpx.Request("PATCH", url))


def test_an_unreachable_api_pauses_the_ui_updates_and_another_api_is_not_paused(
    api_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows import artifacts

    calls: list[str] = []

    class Refusing:
        def update_artifact(self, artifact_id: object, artifact: object) -> None:
            calls.append("update")
            raise RuntimeError("the client gave up") from _refused(f"{API}/artifacts/x")

    monkeypatch.setattr(artifacts, "_client", Refusing)
    monkeypatch.setattr(artifacts, "_unreachable_until", {})
    artifacts.update(uuid.uuid4(), 1.0, "first")
    artifacts.update(uuid.uuid4(), 2.0, "second")  # skipped: it would wait through the client's retries again
    assert calls == ["update"]
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4322/api"}):
        artifacts.update(uuid.uuid4(), 3.0, "another server's")
    assert calls == ["update", "update"]


def test_an_error_that_is_not_the_api_s_absence_pauses_nothing(api_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows import artifacts

    calls: list[str] = []

    class Refusing:
        def update_artifact(self, artifact_id: object, artifact: object) -> None:
            calls.append("update")
            raise ValueError("a bad artifact")

    monkeypatch.setattr(artifacts, "_client", Refusing)
    monkeypatch.setattr(artifacts, "_unreachable_until", {})
    artifacts.update(uuid.uuid4(), 1.0, "first")
    artifacts.update(uuid.uuid4(), 2.0, "second")
    assert calls == ["update", "update"]


def test_a_clip_that_found_the_api_gone_stops_the_archive_and_a_clip_s_own_failure_does_not(api_url: str) -> None:
    from flows.archive.clip_runs import api_lost

    assert api_lost(RuntimeError("Failed to reach API").with_traceback(None)) is False
    gone = RuntimeError(f"Failed to reach API at {API}/")
    gone.__cause__ = _refused(f"{API}/admin/version")
    assert api_lost(gone)
    assert not api_lost(_refused("http://127.0.0.1:9000/bucket/key"))  # the object store's, not the API's
    assert not api_lost(ValueError("the clip's own failure"))


def test_a_failing_logging_handler_writes_nothing_on_the_command_s_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Prefect's log worker writes "--- Error logging to API ---" and its error, without a newline, when it cannot
    send (it honours the stdlib's `logging.raiseExceptions`): the command's next line would be glued to it."""
    import logging
    import os
    import warnings

    from entrypoints import console

    monkeypatch.setattr(logging, "raiseExceptions", True)
    # What configure_terminal sets besides, put back after the test.
    for name in ("DIFFUSERS_VERBOSITY", console.CONSOLE_LEVEL_ENV, console.TELEMETRY_ENV, console.CONSOLE_CLASS_ENV):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setattr(warnings, "filters", list(warnings.filters))
    monkeypatch.setattr(logging.getLogger("diffusers"), "level", logging.getLogger("diffusers").level)

    class Failing(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            try:
                raise ConnectionError("the server went away")
            except ConnectionError:
                self.handleError(record)  # as every stdlib handler does

    logger = logging.getLogger("k6vsr-test-failing-handler")
    monkeypatch.setattr(logger, "handlers", [Failing()])
    monkeypatch.setattr(logger, "propagate", False)
    logger.error("a run log")
    assert "the server went away" in capsys.readouterr().err  # the stdlib's development default
    console.configure_terminal(verbose=False)
    logger.error("a run log")
    assert capsys.readouterr().err == ""
