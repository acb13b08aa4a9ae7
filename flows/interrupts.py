"""An interrupt (Ctrl-C, SIGTERM) that reaches a flow's body stops the process there, when the process asked to.

Prefect turns an interrupt in a flow into a crash only after its task runner has waited for every task in flight,
and the threads computing them cannot be stopped (a denoise may take minutes). So a command that wants to stop at
once registers a handler (`on_interrupt`), and `flows.prefect_server.leased` calls it where the interrupt first
surfaces: in the flow's body, before Prefect's engine sees it. Processes that register nothing (the HTTP API's job
children, tests) keep Prefect's own handling.

What a signal handler raises can also be lost: raised inside a garbage-collection callback or a finaliser, Python
prints it and goes on; raised while a library calls back into Python, it may come out as that library's own error.
So within a flow's body (`noting_signals`) an interrupt is also noted, and if the registered handler has not ended
the process `GRACE_S` after the signal, it is called from a thread of its own.
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
GRACE_S = 0.5  # for the raised interrupt to reach the flow's body before the handler is called without it
# The interrupt this process received while a flow's body ran: a library that catches what a signal handler raised
# and raises its own error instead (pydantic wraps it in a serialization error when the signal lands while it calls
# back into Python) must not turn a stop into an error.
_received: int | None = None


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
        global _received
        _received = signum
        if _handler is not None:
            fallback = threading.Timer(GRACE_S, _handler, (signum,))
            fallback.daemon = True
            fallback.start()
        handler = previous[signum]
        if callable(handler):
            return handler(signum, frame)
        if handler == signal.SIG_DFL:  # what the signal would have done: deliver it again, undisturbed
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        return None

    global _received
    _received = None
    for signum in previous:
        signal.signal(signum, note)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _received = None  # what the block received was answered in it


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
    signum = signal_of(exc)
    if signum is not None and _handler is not None:
        _handler(signum)
