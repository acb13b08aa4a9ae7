"""An interrupt (Ctrl-C, SIGTERM) that reaches a flow's body stops the process there, when the process asked to.

Prefect turns an interrupt in a flow into a crash only after its task runner has waited for every task in flight,
and the threads computing them cannot be stopped (a denoise may take minutes). So a command that wants to stop at
once registers a handler (`on_interrupt`), and `runtime.flow_leases.leased` calls it where the interrupt first
surfaces: in the flow's body, before Prefect's engine sees it. Processes that register nothing (the HTTP API's job
children, tests) keep Prefect's own handling.

Within a flow's body (`noting_signals`) the handler is called from the signal handler itself, before anything is
raised: what a signal handler raises can be lost (inside a garbage-collection callback Python prints it and goes on),
rewrapped (pydantic turns it into a serialization error when the signal lands while it calls back into Python), or
unwound through code that closes the Dask cluster before the handler sees it (the workers then print the scheduler
they lost below the one line). `surfaced` remains for the interrupts Prefect raises itself, and answers each one once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType


class Interrupted(BaseException):
    """SIGTERM outside a flow, raised as Ctrl-C raises KeyboardInterrupt (inside one Prefect raises its own)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


_handler: Callable[[int], object] | None = None
# The interrupt this process received while a flow's body ran: a library that catches what a signal handler raised
# and raises its own error instead (pydantic wraps it in a serialization error when the signal lands while it calls
# back into Python) must not turn a stop into an error.
_received: int | None = None
_answered = False  # the handler was called for it


def on_interrupt(handler: Callable[[int], object] | None) -> None:
    """Call `handler(signal number)` when an interrupt surfaces in the body of a flow of this process (None: stop
    calling one)."""
    global _handler
    _handler = handler


@contextlib.contextmanager
def noting_signals() -> Iterator[None]:
    """For the block, in the main thread: note SIGINT and SIGTERM as they arrive, then handle them as before."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}

    def note(signum: int, frame: FrameType | None) -> object:
        global _received, _answered
        _received = signum
        if _handler is not None and not _answered:
            _answered = True
            _handler(signum)  # a command's handler ends the process here; a test's returns
        handler = previous[signal.Signals(signum)]
        if callable(handler):
            return handler(signum, frame)
        if handler == signal.SIG_DFL:  # what the signal would have done: deliver it again, undisturbed
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        return None

    global _received, _answered
    _received, _answered = None, False
    for signum in previous:
        signal.signal(signum, note)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _received, _answered = None, False  # what the block received was answered in it


def signal_of(exc: BaseException) -> int | None:
    """The signal `exc` stands for, if it is an interrupt (or arrived while an interrupt was being raised)."""
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(exc, Interrupted):
        return exc.signum
    # Prefect's TerminationSignal (SIGTERM inside a flow): only raised once Prefect is imported, and importing it
    # here would cost seconds of a stop that must take less.
    prefect_exceptions = sys.modules.get("prefect.exceptions")
    if prefect_exceptions is not None and isinstance(exc, prefect_exceptions.TerminationSignal):
        return exc.signal
    return _received


def surfaced(exc: BaseException) -> None:
    """Hand an interrupt to the registered handler (which may end the process); anything else is left alone."""
    global _answered
    signum = signal_of(exc)
    if signum is not None and _handler is not None and not _answered:
        _answered = True
        _handler(signum)
