"""What a clip's flow run takes from the code that starts it, beside its parameters: the run context.

A flow run's parameters are its record in the Prefect API, so they must serialize; what the starter holds in memory
(the archive's model queue, shared by the clips it runs together) or decides per run without rebuilding the flow (a
flow's options rebuild its parameters' schema: 55 ms a clip) travels here instead. `flows.orchestrate.run_clip` sets
it around the flow's call; the flow reads it in the thread that calls it (a subflow runs in its caller's thread).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from runtime.lanes import SharedQueue


@dataclass(frozen=True)
class ClipRunContext:
    name: str | None = None  # the flow run's name; None: `upscale-<source's file name>`
    queue: SharedQueue | None = None  # the model and CPU queues the clips of an archive share; None: the clip's own
    rank: int = 0  # the clip's place in `queue`: its model work after every earlier clip's, before later ones'


STANDALONE = ClipRunContext()  # a clip run of its own: named after its source, its own queues
_CURRENT: ContextVar[ClipRunContext] = ContextVar("k6vsr_clip_run", default=STANDALONE)


def current() -> ClipRunContext:
    """The context of the clip run being started or run in this thread."""
    return _CURRENT.get()


@contextlib.contextmanager
def clip_run_context(context: ClipRunContext) -> Iterator[None]:
    token = _CURRENT.set(context)
    try:
        yield
    finally:
        _CURRENT.reset(token)
