"""A local Dask cluster whose start survives a worker killed as it starts.

`distributed` fails a whole cluster's start when one nanny's worker process dies before it reports ("Nanny failed to
start."): the OOM killer as a model loads, an operator's `kill`, a SIGTERM meant for something else. For a command
that is one failed run over a worker it was about to restart anyway; so the start is tried again (the failed one
has closed what it started), a few times, before the error reaches the user.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

STARTS = 3
Cluster = TypeVar("Cluster")


def started(make: Callable[[], Cluster], starts: int = STARTS) -> Cluster:
    """`make()`, made again while it fails because a worker did not start (at most `starts` times in all)."""
    for attempt in range(1, starts + 1):
        try:
            return make()
        except RuntimeError as err:
            if attempt == starts or not _worker_did_not_start(err):
                raise
            logger.warning("a worker died as the cluster started (%s); starting the cluster again", err)
    raise AssertionError("unreachable")


def local_processes(**kwargs: Any) -> Any:
    """`distributed.LocalCluster(**kwargs)`, through `started`: the cluster class of `--workers N`."""
    from distributed import LocalCluster

    return started(lambda: LocalCluster(**kwargs))


def _worker_did_not_start(err: BaseException) -> bool:
    seen: set[int] = set()
    inner: BaseException | None = err
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        if isinstance(inner, RuntimeError) and "Nanny failed to start" in str(inner):
            return True
        inner = inner.__cause__ or inner.__context__
    return False
