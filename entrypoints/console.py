"""What the command line shows while a clip runs: a progress bar over its tiles."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm

from service.runs import PreparedRun
from storage import RunStore


@contextmanager
def tile_progress(prepared: PreparedRun, enabled: bool = True) -> Iterator[None]:
    """A bar over the run's decoded tiles, read from the store so it works with any task runner."""
    if not enabled or not sys.stderr.isatty():
        yield
        return
    store = RunStore(prepared.run.store_root, prepared.run.run_key)
    total = prepared.plan.num_tiles
    stop = threading.Event()
    bar = tqdm(total=total, desc="tiles", unit="tile", file=sys.stderr)

    def poll() -> None:
        while not stop.wait(0.5):
            bar.n = min(total, store.tiles_decoded())
            bar.refresh()

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        bar.n = min(total, store.tiles_decoded())
        bar.close()
