"""torchao is imported by `precision=fp8` alone, never by diffusers in a bf16 process.

diffusers imports torchao as soon as any of its model classes is imported, wherever torchao 0.15 or later is
installed (`diffusers/models/modeling_utils.py` imports `diffusers.quantizers`, whose torchao quantizer imports
torchao at module level). Importing torchao changes what Inductor keys compiled graphs by, so a bf16 process on a
machine with the `fp8` extra missed kernels that a process without torchao had compiled (and printed torchao's own
SyntaxWarning). k6vsr uses none of diffusers' torchao support: the FP8 copy is made with torchao's own API
(`k6vsr_core.device.precision`). So diffusers is told torchao is absent, before its model classes load.

`k6vsr_core` installs this as it is imported, before diffusers is; it imports neither torch nor diffusers.
"""

from __future__ import annotations

import sys
from typing import Any

# diffusers' availability probe: its flag, read when `diffusers.quantizers` is imported.
PROBE = "diffusers.utils.import_utils"
FLAG = "_torchao_available"


class _HideTorchaoFromDiffusers:
    """A meta-path finder that finds nothing: at the first diffusers import after its probe has run, it turns the
    probe's torchao flag off. Its probe module imports torch first, so setting the flag ahead is not possible."""

    def __init__(self) -> None:
        self.done = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if not self.done and name.startswith("diffusers."):
            self.done = _hide()
        return None


def _hide() -> bool:
    probe = sys.modules.get(PROBE)
    if probe is None or not hasattr(probe, FLAG):
        return False
    setattr(probe, FLAG, False)
    return True


def hide_torchao_from_diffusers() -> None:
    """Keep diffusers from importing torchao in this process (idempotent); too late only if it already did."""
    if _hide() or any(isinstance(finder, _HideTorchaoFromDiffusers) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _HideTorchaoFromDiffusers())
