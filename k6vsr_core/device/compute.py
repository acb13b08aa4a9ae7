"""How a run's stages compute, fixed once per run so that resuming, retrying or scaling out never changes a byte.

torch's CPU kernels split their reductions by the intra-op thread count, so the same stage gives other pixels in a
process with another thread count (measured with the tiny bundle: 1 and 2 threads wrote different MP4s). Processes
start with different counts: Dask's nanny exports `OMP_NUM_THREADS=1` to its workers, a command gets one per core.
So the profile is chosen once, when a run is planned, recorded in its manifest, and applied by every process before
it computes a stage of that run; the in-memory runner applies the same default.

On a GPU the profile turns off cuDNN's benchmark mode, which picks convolution kernels by timing them in each
process and so could pick others in another worker, and turns on its deterministic mode; `K6VSR_DETERMINISTIC=0`
leaves both at cuDNN's defaults, only to measure what that costs (`k6vsr_core.device.determinism`, which fixes the other
process-wide kernel choices).
"""

from __future__ import annotations

import os
import threading

from pydantic import BaseModel, ConfigDict, Field

from k6vsr_core import settings
from k6vsr_core.device.determinism import deterministic_requested

THREADS_ENV = settings.env_name("cpu_threads")
_LOCK = threading.Lock()


class ComputeProfile(BaseModel):
    model_config = ConfigDict(frozen=True)

    cpu_threads: int = Field(ge=1, le=1024)  # torch's intra-op threads for every stage
    cudnn_benchmark: bool = False
    cudnn_deterministic: bool = True


def default_profile() -> ComputeProfile:
    """`$K6VSR_CPU_THREADS`, else one thread per core this process may run on (not `OMP_NUM_THREADS`); cuDNN as
    `$K6VSR_DETERMINISTIC` says (default: no timing, deterministic kernels)."""
    threads = settings.read(settings.Compute).cpu_threads or len(os.sched_getaffinity(0))
    deterministic = deterministic_requested()
    return ComputeProfile(cpu_threads=threads, cudnn_benchmark=not deterministic, cudnn_deterministic=deterministic)


def apply_profile(profile: ComputeProfile) -> None:
    """Make this process compute as `profile` says; cheap when it already does."""
    import torch  # here, not above: the manifest records a profile in processes that never compute

    with _LOCK:
        if torch.get_num_threads() != profile.cpu_threads:
            torch.set_num_threads(profile.cpu_threads)
        torch.backends.cudnn.benchmark = profile.cudnn_benchmark
        torch.backends.cudnn.deterministic = profile.cudnn_deterministic
