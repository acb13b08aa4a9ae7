"""storage.processes: a recorded pid is alive only while it runs and is the process recorded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from k6vsr_core.contract.stage_names import Stage
from storage.location import owner
from storage.processes import alive, group_alive, process_start


def test_alive_tells_a_running_process_from_a_dead_zombie_or_reused_pid() -> None:
    assert alive(os.getpid(), process_start(os.getpid()))
    assert not alive(os.getpid(), (process_start(os.getpid()) or 0) + 1)  # the pid given to another process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while process_start(child.pid) is not None:  # exited and not reaped: a zombie
        time.sleep(0.01)
    assert not alive(child.pid)
    child.wait()
    assert not alive(child.pid)


def test_a_group_of_zombies_is_not_alive() -> None:
    """A killed service's processes stay zombies until reaped; `workers stop` must not wait for init to reap them."""
    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert group_alive(leader.pid)
        os.kill(leader.pid, 9)
        while process_start(leader.pid) is not None:  # killed and not reaped: a zombie
            time.sleep(0.01)
        os.killpg(leader.pid, 0)  # the kernel still finds the group...
        assert not group_alive(leader.pid)  # ...but nothing of it runs
    finally:
        leader.kill()
        leader.wait()
    assert not group_alive(leader.pid)


def test_a_dead_writers_temporary_files_are_removed(tmp_path) -> None:
    import socket

    from storage.location import remove_stale_temps

    host = socket.gethostname()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead, mine = tmp_path / f"x-{host}-{child.pid}.a.tmp", tmp_path / f"x-{host}-{os.getpid()}.b.tmp"
    dead.touch()
    mine.touch()
    assert remove_stale_temps(tmp_path, "x-", ".tmp") == [dead] and mine.exists()


def test_a_record_half_written_by_a_killed_process_is_removed_when_the_run_is_next_used(tmp_path) -> None:
    # The writer dies between its temporary file and the rename, as a SIGKILL of a tile's task thread does.
    from storage import RunStore

    store = RunStore(tmp_path, "run")
    record = store.records.path(Stage.DECODE, "0-0")
    writer = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from storage.location import atomic_write_bytes\n"
        "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
        "atomic_write_bytes(Path(sys.argv[1]), b'{}')\n"
    )
    child = subprocess.run([sys.executable, "-c", writer, str(record)], cwd=Path(__file__).parents[2])
    assert child.returncode == -signal.SIGKILL
    left = list(record.parent.glob("*.partial"))
    assert len(left) == 1 and not record.exists()
    live = record.parent / f".0-1.json.{owner()}.abc.partial"  # a live writer's, this process's
    live.touch()

    with store.in_use():
        assert not left[0].exists() and live.exists()
