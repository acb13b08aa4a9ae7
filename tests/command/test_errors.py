"""One error vocabulary: what the user can fix exits 2 in one line, a service that cannot start exits 1 in one line,
anything else (a broken invariant included) is an internal failure; stage tasks retry all but the user's errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from entrypoints import cli
from entrypoints.commands import gc as gc_command
from k6vsr_core.errors import (
    ParameterError,
    describe_error,
)
from k6vsr_core.model.memory import MemoryBudgetError
from runtime.service_errors import ServerError, WorkersError


def test_a_plain_value_error_is_not_the_users_fault() -> None:
    assert describe_error(ValueError("window 3 has 5 frames, expected 9")) is None
    assert describe_error(ParameterError("scale=3 is not supported")) == "scale=3 is not supported"
    assert describe_error(MemoryBudgetError("8.0 GiB free")) == "8.0 GiB free"
    assert describe_error(ServerError("the Prefect server exited while starting")) is None


def test_an_internal_invariant_failure_exits_1_as_an_internal_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stage handed frames that do not match the plan is k6vsr's bug, not a usage error."""
    from k6vsr_core.model import stages

    def broken(_: Any) -> dict[str, Any]:
        return {"tensor": stages.frames_to_tensor(np.zeros((2, 4, 4), dtype=np.uint8))}

    monkeypatch.setattr(gc_command, "run", broken)
    assert cli.main(["gc"]) == cli.EXIT_FAILED
    line = capsys.readouterr().err.strip()
    assert line.startswith("k6vsr: error: ValueError: frames must be uint8") and "--debug" in line


def _wait_for_the_scheduler() -> None:
    raise TimeoutError


def _wrapped() -> None:
    try:
        raise OSError("Timed out trying to connect to tcp://127.0.0.1:8786 after 30 s")
    except OSError as err:
        raise TimeoutError from err


def test_an_error_without_a_message_still_names_its_cause(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A library's bare `TimeoutError()` printed `k6vsr: error: TimeoutError:` and nothing after the colon."""
    for raising, said in (
        (_wait_for_the_scheduler, "TimeoutError (no message) raised in _wait_for_the_scheduler at test_errors.py:"),
        (_wrapped, "TimeoutError, from OSError: Timed out trying to connect to tcp://127.0.0.1:8786 after 30 s"),
    ):
        monkeypatch.setattr(gc_command, "run", lambda _, raising=raising: raising())
        assert cli.main(["gc"]) == cli.EXIT_FAILED
        line = capsys.readouterr().err.strip()
        assert line.startswith(f"k6vsr: error: {said}") and line.endswith("(rerun with --debug for details)"), line


@pytest.mark.parametrize(
    ("command", "target", "error"),
    [
        (["server", "start"], "runtime.prefect_server.start_server", ServerError("the Prefect server exited; see log")),
        (["workers", "start"], "runtime.warm_workers.start_workers", WorkersError("the warm workers exited; see log")),
    ],
)
def test_a_service_that_cannot_start_is_one_clear_line(
    command: list[str],
    target: str,
    error: Exception,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def refuse(*_: Any, **__: Any) -> None:
        raise error

    monkeypatch.setattr(target, refuse)
    assert cli.main(command) == cli.EXIT_FAILED
    assert capsys.readouterr().err == f"k6vsr: error: {error}\n"


def test_a_request_the_clip_cannot_take_is_a_parameter_error() -> None:
    """hevc below x265's smallest side is the user's choice: refused as a ParameterError, for a latent run too."""
    from k6vsr_core.contract.params import parse_params
    from k6vsr_core.contract.plan import make_plan

    with pytest.raises(ParameterError, match="codec=hevc needs an output of at least"):
        make_plan((32, 32), 9, 24.0, parse_params(scale=2, codec="hevc"))
