"""An interrupt (Ctrl-C, SIGTERM) that reaches a flow's body stops the process there, when the process asked to.

Prefect turns an interrupt in a flow into a crash only after its task runner has waited for every task in flight,
and the threads computing them cannot be stopped (a denoise may take minutes). So a command that wants to stop at
once registers a handler (`on_interrupt`), and `flows.prefect_server.leased` calls it where the interrupt first
surfaces: in the flow's body, before Prefect's engine sees it. Processes that register nothing (the HTTP API's job
children, tests) keep Prefect's own handling.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable


class Interrupted(BaseException):
    """SIGTERM outside a flow, raised as Ctrl-C raises KeyboardInterrupt (inside one Prefect raises its own)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


_handler: Callable[[int], object] | None = None


def on_interrupt(handler: Callable[[int], object] | None) -> None:
    """Call `handler(signal number)` when an interrupt surfaces in the body of a flow of this process (None: stop
    calling one)."""
    global _handler
    _handler = handler


def signal_of(exc: BaseException) -> int | None:
    """The signal `exc` stands for, if it is an interrupt."""
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(exc, Interrupted):
        return exc.signum
    # Prefect's TerminationSignal (SIGTERM inside a flow): only raised once Prefect is imported, and importing it
    # here would cost seconds of a stop that must take less.
    prefect_exceptions = sys.modules.get("prefect.exceptions")
    if prefect_exceptions is not None and isinstance(exc, prefect_exceptions.TerminationSignal):
        return exc.signal
    return None


def surfaced(exc: BaseException) -> None:
    """Hand an interrupt to the registered handler (which may end the process); anything else is left alone."""
    signum = signal_of(exc)
    if signum is not None and _handler is not None:
        _handler(signum)
