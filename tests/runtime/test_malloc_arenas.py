"""The command's malloc arenas: two, whatever the number of threads, and the limit handed to the processes it
starts; a limit the user set is left as it is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Eight threads each allocate from glibc's malloc at once, then the process counts its arenas (malloc_info's heaps).
THREADS_THEN_HEAPS = r"""
import ctypes, os, sys, tempfile, threading
from runtime.malloc_arenas import limit_malloc_arenas
print("limit", limit_malloc_arenas(), os.environ.get("MALLOC_ARENA_MAX"))
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
barrier = threading.Barrier(8)
def allocate():
    barrier.wait()
    libc.malloc(4096)
    barrier.wait()
threads = [threading.Thread(target=allocate) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
path = tempfile.mktemp()
handle = libc.fopen(path.encode(), b"w")
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.malloc_info(0, handle)
libc.fclose.argtypes = [ctypes.c_void_p]
libc.fclose(handle)
print("heaps", open(path).read().count("<heap nr="))
os.unlink(path)
"""


def _run(env_extra: dict[str, str], drop: bool) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if not (drop and k == "MALLOC_ARENA_MAX")}
    env.update(env_extra, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", THREADS_THEN_HEAPS], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    return lines["limit"], int(lines["heaps"])


def test_eight_threads_share_two_arenas_and_children_are_told() -> None:
    limit, heaps = _run({}, drop=True)
    assert limit == "2 2" and heaps <= 2


def test_a_limit_the_user_set_is_kept() -> None:
    """Also the contrast: with room for eight arenas, eight threads take more than two."""
    limit, heaps = _run({"MALLOC_ARENA_MAX": "8"}, drop=False)
    assert limit == "None 8" and heaps > 2
