"""The local server's SQLite writes: a transaction that reads, then writes after another connection committed, waits
for the lock instead of failing (which Prefect's server answers with a 503 and its client with a 2 s pause)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import sqlalchemy as sa
from prefect.server.database.configurations import AioSqliteConfiguration

from runtime.sqlite_writes import take_write_lock_at_begin


async def _read_then_write_while_another_commits(path: Path) -> int:
    """Transaction A reads, B inserts and commits (or is made to wait), then A inserts: the rows in the end."""
    config = AioSqliteConfiguration(connection_url=f"sqlite+aiosqlite:///{path}")
    engine = await config.engine()
    try:
        async with engine.begin() as conn:
            await conn.execute(sa.text("CREATE TABLE IF NOT EXISTS runs (name TEXT)"))
        read, b_done = asyncio.Event(), asyncio.Event()

        async def a() -> None:
            session = await config.session(engine)
            async with session, config.begin_transaction(session):
                await session.execute(sa.text("SELECT count(*) FROM runs"))  # A's snapshot
                read.set()
                try:  # B commits meanwhile, unless A already holds the write lock
                    await asyncio.wait_for(b_done.wait(), timeout=1.0)
                except TimeoutError:
                    pass
                await session.execute(sa.text("INSERT INTO runs VALUES ('a')"))

        async def b() -> None:
            await read.wait()
            session = await config.session(engine)
            async with session, config.begin_transaction(session):
                await session.execute(sa.text("INSERT INTO runs VALUES ('b')"))
            b_done.set()

        await asyncio.gather(a(), b())
        async with engine.connect() as conn:
            return (await conn.execute(sa.text("SELECT count(*) FROM runs"))).scalar_one()
    finally:
        await engine.dispose()


def test_prefect_s_deferred_transaction_fails_when_another_wrote_since_it_read(tmp_path: Path) -> None:
    """Why the change is made: as Prefect begins them, A's write fails at once (SQLITE_BUSY_SNAPSHOT)."""
    with pytest.raises(sa.exc.OperationalError, match="database is locked"):
        asyncio.run(_read_then_write_while_another_commits(tmp_path / "deferred.db"))


def test_with_the_lock_taken_at_begin_both_writes_land(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AioSqliteConfiguration, "begin_transaction", AioSqliteConfiguration.begin_transaction)
    take_write_lock_at_begin()
    take_write_lock_at_begin()  # once is enough; twice changes nothing
    assert asyncio.run(_read_then_write_while_another_commits(tmp_path / "immediate.db")) == 2
