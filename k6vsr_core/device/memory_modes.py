"""The memory modes a run may ask for, written once: `k6vsr_core.model.memory` reasons with them, the command line and
the request models offer them. Apart from it because it imports nothing heavy (a command's `--help` reads it)."""

from __future__ import annotations

from typing import Literal, get_args

BudgetName = Literal["fast", "24g", "16g"]
MemoryMode = Literal["auto", BudgetName]  # the allowed values, written here only
MEMORY_MODES: tuple[str, ...] = get_args(MemoryMode)
