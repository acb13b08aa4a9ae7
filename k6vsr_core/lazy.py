"""Names a package exports but imports only when first used: `k6vsr_core`'s and `k6vsr_core.media`'s, whose
modules load torch, diffusers or PyAV, which a command that only parses its flags must not pay."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_attributes(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A package's `__getattr__` (PEP 562) that imports the module a name lives in, `homes[name]` below `package`, on
    first use."""

    def attribute(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{home}"), name)

    return attribute
