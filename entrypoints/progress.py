"""The terminal's progress displays: a clip run's bar over every (window, tile) item, with its stage and window; an
archive's bar over its clips.

Read from the run store's records, so it works whichever processes compute (threads, Dask workers, warm workers)
and counts what a resumed run had already finished. Stages overlap (window 2 encodes while window 1 decodes): the
display names the stage of the earliest window not yet decoded, which is what holds the run back.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from k6vsr_core.plan import ClipPlan
from service.runs import PreparedRun
from storage import RunStore

POLL_S = 0.5


def run_stage(store: RunStore, plan: ClipPlan) -> tuple[str, int]:
    """The stage the run is in and the window (from 0) it works on."""
    records = store.records
    encoded = set(records.items("encode"))
    if not encoded and "all" not in records.items("ingest"):
        return "ingest", 0
    decoded = store.decoded_per_window(plan.num_windows)
    window = next((w for w, count in enumerate(decoded) if count < plan.num_tiles), None)
    if window is None:
        last = plan.num_windows - 1
        return ("blend and segment" if len(records.items("segment")) < plan.num_windows else "mux"), last
    if str(window) not in encoded:
        return "encode", window
    denoised = sum(1 for item in records.items("denoise") if item.split("-", 1)[0] == str(window))
    return ("denoise" if denoised < plan.num_tiles else "decode"), window


def describe(stage: str, window: int, plan: ClipPlan) -> str:
    return f"{stage}, window {window + 1} of {plan.num_windows}" if plan.num_windows > 1 else stage


@contextmanager
def shown_while_running(bar: tqdm, show: Callable[[], None], thread_name: str) -> Iterator[None]:
    """While the block runs, `show` every POLL_S seconds on a thread of its own; the bar is closed after it."""
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(POLL_S):
            show()

    thread = threading.Thread(target=poll, name=thread_name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        bar.close()


@contextmanager
def run_progress(prepared: PreparedRun, enabled: bool = True) -> Iterator[None]:
    """While the block runs, a bar on a terminal's stderr: items decoded of the run's total, the stage, the window,
    and tqdm's rate and time left (counted from what this run computes, not from what it reused)."""
    if not enabled or not sys.stderr.isatty():
        yield
        return
    plan = prepared.plan
    store = RunStore(prepared.run.store_root, prepared.run.run_key)
    total = plan.num_windows * plan.num_tiles
    bar = tqdm(total=total, initial=min(total, store.tiles_decoded()), unit="tile", file=sys.stderr, leave=False)

    def show() -> None:
        bar.set_description_str(describe(*run_stage(store, plan), plan), refresh=False)
        bar.update(min(total, store.tiles_decoded()) - bar.n)

    show()
    with shown_while_running(bar, show, "k6vsr-progress"):
        yield


def clips_text(statuses: list[str]) -> tuple[str, int, int]:
    """An archive's clips as the bar says them, and how many are finished of how many to run."""
    done, failed, left = statuses.count("done"), statuses.count("failed"), statuses.count("planned")
    return f"clips: {done} done, {failed} failed, {left} left", done + failed, done + failed + left


@contextmanager
def archive_progress(manifest: Path, enabled: bool = True) -> Iterator[None]:
    """While the block runs, a bar on a terminal's stderr over the clips an archive runs, read from its manifest
    (rewritten as each clip ends); a manifest older than the block is a previous run's, and not read."""
    if not enabled or not sys.stderr.isatty():
        yield
        return
    started = time.time()
    bar = tqdm(total=0, unit="clip", file=sys.stderr, leave=False, desc="planning the clips")

    def show() -> None:
        try:
            if manifest.stat().st_mtime < started:
                return
            rows = json.loads(manifest.read_text())["rows"]
        except (OSError, ValueError, KeyError):  # not written yet, or being replaced
            return
        text, finished, total = clips_text([row["status"] for row in rows])
        bar.total = total
        bar.set_description_str(text, refresh=False)
        bar.update(finished - bar.n)

    with shown_while_running(bar, show, "k6vsr-archive-progress"):
        yield
