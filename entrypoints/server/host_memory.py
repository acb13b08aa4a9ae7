"""Host memory of the server and its jobs, bounded by `--memory-budget-mb`: what a job will hold, estimated from its
plan at submit (a job that cannot fit is refused there, naming the budget), and what the processes hold, measured
while jobs run (a job whose process outgrows the budget anyway is stopped, and fails naming it).

File sizes and tile counts do not bound memory: a few kilobytes of video can declare frames of any size, and a
window's frames are held decoded, encoded into latents, decoded into tiles and blended at the output's size. The
estimate follows those: per pixel-frame of a window's source and of its result, per tile task, and on a CPU per
pixel-frame of a KVAE call. Its constants are upper bounds of what a warm job process was measured to add with the
tiny bundle on a CPU (bench/RESULTS.md, 2026-12-03); the idle size itself (the model, the libraries) is measured,
not estimated: the size of a worker process waiting for a job, counted at `DEFAULT_WORKER_BYTES` at least.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20
# What one job adds to its worker process, per pixel-frame of a window at the output's size (blend accumulators in
# float32, the decoded tiles, the delivered frames and the encoder's copies), per pixel-frame of a window's padded
# source (decoded frames, the padded clip, the encoder's float input) and per tile task of a window (its latents,
# its decoded pixels, the task's own bookkeeping).
BYTES_PER_OUTPUT_PIXEL = 64
BYTES_PER_SOURCE_PIXEL = 48
BYTES_PER_TILE = MIB
# On a CPU the model's activations are host memory too: per pixel-frame of one KVAE call (a tile decoded, the
# source encoded), at most `KVAE_CALL_FRAMES` frames a call (the KVAE's own segments). A 2-tile job of 17 frames of
# 192x128 grew its process by 682 MB (2026-12-03): 2.4 KB per pixel-frame of its decode calls.
BYTES_PER_KVAE_PIXEL = 3 * 1024
KVAE_CALL_FRAMES = 17
# Windows whose data a job holds at once: the one being computed and the one being blended and encoded.
WINDOWS_HELD = 2
# The least a worker process is counted at: the libraries, a small model, and what its first job imports.
DEFAULT_WORKER_BYTES = 1024 * MIB


def job_bytes(plan: Any, on_cpu: bool) -> int:
    """Host memory a job of `plan` (a `ClipPlan`) adds to its worker process at its peak, at most; `on_cpu`: the
    model computes on the CPU, so its activations count too."""
    frames = plan.window_frames
    out_h, out_w = plan.sr_size
    del_h, del_w = plan.delivery_size
    src_h, src_w = plan.grid.padded_size
    tile_h, tile_w = plan.grid.base
    output = frames * max(out_h * out_w, del_h * del_w)
    source = frames * src_h * src_w
    window = BYTES_PER_OUTPUT_PIXEL * output + BYTES_PER_SOURCE_PIXEL * source + BYTES_PER_TILE * plan.num_tiles
    held = window * min(WINDOWS_HELD, plan.num_windows)
    if on_cpu:
        call_frames = min(frames, KVAE_CALL_FRAMES)
        held += BYTES_PER_KVAE_PIXEL * call_frames * max(tile_h * tile_w, src_h * src_w)
    return held


def computes_on_cpu(device: str) -> bool:
    """Whether a job process of `device` ("cpu", "cuda[:n]", "auto") computes on the CPU; for "auto", whether this
    machine has no NVIDIA device (the server itself imports no torch)."""
    if device == "auto":
        return not os.path.exists("/dev/nvidia0")
    return device == "cpu"


def own_rss() -> int:
    """Resident bytes of this process."""
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss


def tree_rss(pid: int) -> int:
    """Resident bytes of process `pid` and its descendants (0 once it is gone)."""
    import psutil  # here: the job process imports this module before it is bound to its parent

    try:
        process = psutil.Process(pid)
        family = [process, *process.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for member in family:
        try:
            total += member.memory_info().rss
        except psutil.Error:
            continue
    return total


@dataclass
class MemoryLedger:
    """The budget, and what was last measured of the processes under it: the server's own size, and the size a
    worker process is counted at: the largest measured idle (waiting for a job), and never less than
    `DEFAULT_WORKER_BYTES`, which covers what a worker's first job loads beyond its idle size after start (the
    pipeline's imports: about 350 MB with the tiny bundle)."""

    budget: int
    server_bytes: int = 0
    worker_bytes: int = DEFAULT_WORKER_BYTES

    def job_room(self, workers: int) -> int:
        """What one job may add to its worker, with every worker running one: the budget less the server and the
        workers' idle sizes, shared by the workers."""
        return (self.budget - self.server_bytes - workers * self.worker_bytes) // workers

    def idle_worker(self, size: int) -> None:
        self.worker_bytes = max(self.worker_bytes, size)
