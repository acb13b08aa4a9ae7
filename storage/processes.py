"""Whether a process recorded by its pid still runs: the detached services' records (`runtime.state_folder`) and the
run store's temporary files (named by their writer's pid) both ask.

A recorded pid may outlive its process and be given to another: a record that keeps the process's start time too
tells the two apart.
"""

from __future__ import annotations

import os
from pathlib import Path


def process_start(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot): tells a live process from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19]) if fields[0] != "Z" else None


_start_of = process_start  # `alive`'s parameter takes the name: the record's field it is compared with


def alive(pid: int, process_start: int | None = None) -> bool:
    """`pid` runs (not a zombie) and, where its start time was recorded, is the same process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # some other user's process: alive, and not ours
    started = _start_of(pid)
    if started is None:
        return not Path("/proc").is_dir()  # a zombie on Linux; elsewhere, trust kill(0)
    return process_start is None or started == process_start


def group_alive(pgid: int) -> bool:
    """A process of group `pgid` runs. Zombies do not count: a killed service's processes are handed to init, which
    may take a second or more to reap them, and `killpg(pgid, 0)` still finds them until then."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it ended while we looked
        state, _ppid, group = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(group) == pgid and state != "Z":
            return True
    return False
