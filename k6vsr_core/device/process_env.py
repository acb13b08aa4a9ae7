"""What every process that computes must have in its environment before its first CUDA call and its first compile.

Both are read once, when first needed, and then fixed for the process's life: PyTorch's caching allocator reads
`PYTORCH_CUDA_ALLOC_CONF` as CUDA starts, and Inductor its cache folder the first time anything asks for it (and
then writes `TORCHINDUCTOR_CACHE_DIR` itself, to its default `/tmp/torchinductor_<user>`: merely importing torch's
flex attention does). So `k6vsr_core` sets them as it is imported, before any of its modules imports torch: in the
command, for itself and every process it starts (warm workers, Dask workers, the HTTP server's jobs), and in any
process that runs k6vsr's tasks or the in-memory runner. A value the environment already has wins. No torch here:
the command must not import it to start.
"""

from __future__ import annotations

import os
from pathlib import Path

from k6vsr_core import settings

ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"
# Expandable segments let the CUDA caching allocator grow a segment instead of reserving a new one for every size
# class the stages ask for: with the two model slots' encode, denoise and decode interleaved, fixed segments left a
# command's reserved memory several GiB above what it ever allocated.
ALLOCATOR_DEFAULT = "expandable_segments:True"
COMPILE_CACHE_ENV = settings.env_name("compile_cache")
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
# SVT-AV1 (`--codec av1`) prints its whole configuration to stderr as each segment's encoder starts; 1 keeps its
# errors. It reads the variable as an encoder starts, so setting it here is in time.
SVT_LOG_ENV = "SVT_LOG"
SVT_LOG_ERRORS = "1"


def compile_cache_dir() -> Path:
    """`$K6VSR_COMPILE_CACHE`, else `<XDG cache or ~/.cache>/k6vsr/compile`."""
    explicit = settings.read(settings.Compute).compile_cache
    if explicit is not None:
        return explicit.expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "k6vsr" / "compile"


def compute_defaults() -> None:
    """The allocator's settings, Inductor's cache folder (under the compile cache) and SVT-AV1's log level for
    this process and the processes it starts, unless the environment chose its own."""
    os.environ.setdefault(ALLOC_ENV, ALLOCATOR_DEFAULT)
    os.environ.setdefault(INDUCTOR_CACHE_ENV, str(compile_cache_dir() / "inductor"))
    os.environ.setdefault(SVT_LOG_ENV, SVT_LOG_ERRORS)
