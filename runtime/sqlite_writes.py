"""The local Prefect server on SQLite: a write transaction takes SQLite's write lock when it begins.

Prefect's server opens its transactions DEFERRED unless a caller asks for `with_for_update`. Under WAL, a deferred
transaction that reads and then writes fails at once with SQLITE_BUSY_SNAPSHOT when another connection committed
in between: the busy timeout (60 s) is never consulted, the server answers 503, and Prefect's client sleeps about
2 s before it asks again. An archive run has that race all the time (the task-run recorder writes every event while
the clips create their flow and task runs): 8 such answers in 20 one-window clips, a clip thread asleep for about
a third of its time (bench/RESULTS.md). With BEGIN IMMEDIATE the lock is taken at the start, so a second writer
waits in the busy handler, for milliseconds, instead of failing. SQLite has one writer at a time either way; readers
outside a transaction (most of the API's GETs and filters) are not affected under WAL.

`python -m runtime.sqlite_writes server start ...` is `prefect server start ...` with that change; it is how the
local server runs (runtime.prefect_server). PostgreSQL servers are left as Prefect makes them.
"""

from __future__ import annotations

import sys
from typing import Any

_MARK = "_k6vsr_immediate"


def take_write_lock_at_begin() -> None:
    """Make every transaction Prefect's SQLite configuration begins an IMMEDIATE one (idempotent)."""
    from prefect.server.database.configurations import AioSqliteConfiguration

    deferred_or_not = AioSqliteConfiguration.begin_transaction
    if getattr(deferred_or_not, _MARK, False):
        return

    def begin_transaction(self: AioSqliteConfiguration, session: Any, with_for_update: bool = False) -> Any:
        return deferred_or_not(self, session, with_for_update=True)

    setattr(begin_transaction, _MARK, True)
    AioSqliteConfiguration.begin_transaction = begin_transaction  # type: ignore[method-assign]


def main() -> None:
    take_write_lock_at_begin()
    from prefect.cli import app

    sys.argv[0] = "prefect"
    app()


if __name__ == "__main__":
    main()
