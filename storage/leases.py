"""Liveness in an object store, where there is no flock: leases that expire, and `gc` that deletes only runs none holds.

A live run keeps `leases/<host>-<pid>-<id>.json` under its prefix, rewritten every third of its term, so a run killed
outright stops renewing and its lease lapses. `gc` and a starting run each write their own marker before they look
for the other's (`gc.json`, a conditional write, against the leases): with an object store's read-after-write
consistency at least one of the two sees the other, so `gc` never deletes a run that is starting or running.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Collection, Iterator
from contextlib import contextmanager, suppress
from typing import Any

from k6vsr_core import settings
from k6vsr_core.errors import StoreError
from storage.location import RemoteLocation

LEASES = "leases"
GC_MARKER = "gc.json"
# What `--keep-outputs` keeps of a finished run.
KEPT = ("output.mp4", "manifest.json", "done")


def lease_seconds() -> float:
    """How long a lease lasts without renewal: the longest `gc` may have to wait for a killed run's prefix."""
    return settings.read(settings.Store).lease_seconds


def _stamp(seconds: float) -> bytes:
    """A lease's or marker's content: until when it holds, and who wrote it."""
    return json.dumps({"expires_at": time.time() + seconds, "host": socket.gethostname(), "pid": os.getpid()}).encode()


def _holds(stamp: RemoteLocation, now: float) -> bool:
    """Present and not expired (an unreadable stamp holds: it is being written)."""
    try:
        return float(json.loads(stamp.read_bytes())["expires_at"]) > now
    except FileNotFoundError:
        return False  # released meanwhile
    except (ValueError, KeyError, TypeError):
        return True


def _live(run: RemoteLocation, now: float) -> list[str]:
    """The names of the leases on `run` that hold."""
    return [name for name in (run / LEASES).names(".json") if _holds(run / LEASES / name, now)]


def _claim(marker: RemoteLocation, now: float) -> bool:
    """Write the gc marker, if no other gc holds it; one left by a gc that died holds only until it expires."""
    if marker.create(_stamp(lease_seconds())):
        return True
    if _holds(marker, now):
        return False
    marker.remove()
    return marker.create(_stamp(lease_seconds()))


@contextmanager
def held(run: RemoteLocation, seconds: float | None = None, poll_s: float = 1.0) -> Iterator[None]:
    """Hold a lease on `run` while the block runs (`seconds` without renewal, default `lease_seconds()`); waits
    while a `gc` of it is under way."""
    seconds = lease_seconds() if seconds is None else seconds
    lease = run / LEASES / f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
    while True:
        lease.write_bytes(_stamp(seconds))
        if not _holds(run / GC_MARKER, time.time()):
            break
        lease.remove()  # a gc is deciding: let it finish, then start on what it left
        time.sleep(poll_s)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(seconds / 3):
            try:
                lease.write_bytes(_stamp(seconds))
            except StoreError:
                pass  # the next renewal may pass; the run's own store calls report an unreachable store

    renewer = threading.Thread(target=renew, name="k6vsr-lease", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        with suppress(StoreError):  # a lease left behind lapses by itself; the run's own outcome says more
            lease.remove()


def reclaimed_reason(output_kept: bool, dry_run: bool) -> str:
    """A reclaimed run's reason in gc's report: with `dry_run` (`deleted` then means "would be"), what would be."""
    if output_kept:
        return "intermediates would be reclaimed, output kept" if dry_run else "intermediates reclaimed, output kept"
    return "would be reclaimed" if dry_run else "reclaimed"


def collect(
    root: RemoteLocation,
    keep_finished_outputs: bool,
    older_than_s: float,
    run_keys: Collection[str] | None,
    dry_run: bool = False,
) -> list[dict[str, Any]]:
    """`collect_garbage` of an object store: the same report, with leases in place of flock; `dry_run` deletes
    nothing."""
    runs = root / "runs"
    keys = sorted(run_keys if run_keys is not None else runs.names(""))
    report = []
    for key in keys:
        run = runs / key
        objects = run.objects()
        if not objects:
            continue
        entry: dict[str, Any] = {"run_key": key, "bytes": sum(size for size, _ in objects.values())}
        now = time.time()
        if now - max(modified for _, modified in objects.values()) < older_than_s:
            report.append({**entry, "deleted": False, "reason": "recent"})
            continue
        marker = run / GC_MARKER
        if not _claim(marker, now):
            report.append({**entry, "deleted": False, "reason": "another gc is deciding"})
            continue
        try:
            if _live(run, now):
                report.append({**entry, "deleted": False, "reason": "in use by a live run"})
                continue
            # Only what was listed: a run's later objects are written after it saw the marker gone, below.
            if keep_finished_outputs and "output.mp4" in objects:
                if not dry_run:
                    run.remove_all([name for name in objects if name.split("/", 1)[0] not in KEPT])
                report.append({**entry, "deleted": True, "reason": reclaimed_reason(True, dry_run)})
            else:
                if not dry_run:
                    run.remove_all(list(objects))
                report.append({**entry, "deleted": True, "reason": reclaimed_reason(False, dry_run)})
        finally:
            marker.remove()  # last: a starting run waits for it
    return report
