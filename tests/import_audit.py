"""Runs a module as `python -m` does, recording whether torch or diffusers were imported, and where first.

`python tests/import_audit.py REPORT MODULE ARGS...`: at exit, REPORT (JSON) holds the heavy modules in
`sys.modules` and the stack of the first import of each, so a test that finds one names the code that pulled it in.
"""

from __future__ import annotations

import atexit
import json
import runpy
import sys
import traceback
from pathlib import Path

HEAVY = ("torch", "diffusers")


class _FirstImports:
    """A meta-path finder that finds nothing: it only notes the stack of each heavy package's first import."""

    def __init__(self) -> None:
        self.stacks: dict[str, str] = {}

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        top = name.partition(".")[0]
        if top in HEAVY and top not in self.stacks:
            self.stacks[top] = "".join(traceback.format_stack(limit=30))


def main() -> None:
    report, module, *argv = sys.argv[1:]
    finder = _FirstImports()
    sys.meta_path.insert(0, finder)

    def write() -> None:
        imported = sorted(name for name in HEAVY if name in sys.modules)
        Path(report).write_text(json.dumps({"imported": imported, "stacks": finder.stacks}))

    atexit.register(write)
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
