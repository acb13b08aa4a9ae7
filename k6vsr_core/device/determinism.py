"""The process-wide settings that decide which GPU kernels compute a stage, fixed so that every process picks the same.

A library that chooses a kernel by timing candidates on the device (cuDNN's benchmark mode, Inductor's autotuning)
can choose another one in another process, or on a busier card, and another kernel rounds differently: the output's
bytes would then depend on which process computed a tile. `apply_kernel_settings` turns those choices into fixed
ones. `load_bundle` calls it, so every process that computes (the command, Dask and warm workers, the HTTP server's
job processes, the in-memory runner's caller) has them before its model's first kernel; the cuDNN flags are part
of the run's compute profile (`k6vsr_core.device.compute`), applied again before every stage, and follow the same
switch.

What each setting does, and what it costs where known (`bench/device_check.py --runs same-bytes` times a run with
and without them):

- Inductor `deterministic`: no on-device benchmarking where it could change numerics (reduction configs are
  filtered to the ones whose order is fixed; pad_mm and fusion decisions are made by estimates). PyTorch warns of a
  performance hit; not yet measured here.
- Inductor `max_autotune*` and `coordinate_descent_tuning` off (their defaults): both pick kernels or block sizes
  by timing them. They are off by default; setting them here keeps an environment variable from turning them on.
- `CUBLAS_WORKSPACE_CONFIG=:4096:8`: a fixed cuBLAS workspace per handle and stream, which NVIDIA documents as the
  condition for cuBLAS to give the same bits on every run when several streams are in use (a streamed upscaler
  prefetches on a side stream). Costs 32 MiB of GPU memory per handle and stream (8 buffers of 4 MiB), about what
  PyTorch reserves by default on recent cards; no time cost is expected. It is read when a process creates its
  first cuBLAS handle, so it must be set before the first matrix product: loading the bundle comes before it.
- cuDNN benchmark mode off, deterministic mode on (through the compute profile): no algorithm search by timing.
  The cost depends on the convolution shapes; not yet measured here.
- `torch.use_deterministic_algorithms(True, warn_only=True)` (which Inductor also reads when it picks reduction
  configs), Inductor's pointwise autotuning (`triton.autotune_pointwise`) and its occupancy-driven RBLOCK scaling
  (`dynamic_scale_rblock`) off. With the settings above alone, three processes that compiled the KVAE decoder at
  once from cold caches decoded one latent to two different outputs on an H200; with these added, to one, at no
  measurable cost to the hot decode (`bench/decode_determinism.py`, bench/RESULTS.md). Uninitialised memory is not
  filled (`torch.utils.deterministic.fill_uninitialized_memory`, which the first setting turns on): correct code
  never reads it, and filling every new tensor costs time.

`K6VSR_DETERMINISTIC=0` leaves all of them at the libraries' defaults (cuDNN benchmark mode on), only to measure
what determinism costs; outputs are then not promised to match across processes.
"""

from __future__ import annotations

import os
import threading

from pydantic import BaseModel, ConfigDict

from k6vsr_core import settings

SWITCH_ENV = settings.env_name("deterministic")
CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_WORKSPACE = ":4096:8"
# Inductor options that choose kernels by timing them on the device; all off by default.
INDUCTOR_TIMING_OPTIONS = (
    "max_autotune",
    "max_autotune_gemm",
    "max_autotune_pointwise",
    "coordinate_descent_tuning",
)
_LOCK = threading.Lock()


class KernelSettings(BaseModel):
    """What `apply_kernel_settings` left in force in this process."""

    model_config = ConfigDict(frozen=True)

    deterministic: bool
    inductor_deterministic: bool | None  # None: the installed torch has no such option
    inductor_timing_off: tuple[str, ...]  # the timing options this torch offers, turned off
    cublas_workspace: str | None


def deterministic_requested() -> bool:
    """The switch: on unless `K6VSR_DETERMINISTIC` is 0, false, no or off."""
    return settings.read(settings.Compute).deterministic


def apply_kernel_settings(deterministic: bool | None = None) -> KernelSettings:
    """Fix this process's kernel choices (`deterministic`, default: the switch); cheap and idempotent."""
    from torch._inductor import config as inductor_config

    on = deterministic_requested() if deterministic is None else deterministic
    with _LOCK:
        has_deterministic = hasattr(inductor_config, "deterministic")
        if has_deterministic:
            inductor_config.deterministic = on
        timing_off = []
        for name in INDUCTOR_TIMING_OPTIONS:
            if on and hasattr(inductor_config, name):
                setattr(inductor_config, name, False)
                timing_off.append(name)
        if on:
            # An explicit value from the environment wins: it was chosen knowingly (e.g. ":16:8" to save memory).
            os.environ.setdefault(CUBLAS_ENV, CUBLAS_WORKSPACE)
        _strict_kernels(on)
        return KernelSettings(
            deterministic=on,
            inductor_deterministic=bool(inductor_config.deterministic) if has_deterministic else None,
            inductor_timing_off=tuple(timing_off),
            cublas_workspace=os.environ.get(CUBLAS_ENV),
        )


def _strict_kernels(on: bool) -> None:
    """The settings the H200 measurement added to Inductor's deterministic mode (see above)."""
    import torch
    from torch._inductor import config as inductor_config

    torch.use_deterministic_algorithms(on, warn_only=True)
    if on:
        # torch gives this module a class with the property as it is imported; its stub cannot say so.
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    inductor_config.triton.autotune_pointwise = not on
    if hasattr(inductor_config, "dynamic_scale_rblock"):
        inductor_config.dynamic_scale_rblock = not on
