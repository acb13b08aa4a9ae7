"""`k6vsr cache export|import|status`: the compiled-kernel cache."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from k6vsr_core.device import compile_cache
from k6vsr_core.errors import UserFacingError


def run(args: argparse.Namespace) -> dict[str, Any]:
    """`k6vsr cache export|import|status [FILE]`: PyTorch's cache artefacts of the kernels compiled here."""
    if args.action in ("export", "import") and not args.file:
        raise UserFacingError(f"k6vsr cache {args.action} needs a FILE")
    if args.action == "export":
        try:
            manifest = compile_cache.export_cache(Path(args.file).expanduser().absolute())
        except FileNotFoundError as err:
            raise UserFacingError(str(err)) from None
        return {"action": "export", "file": str(Path(args.file).absolute()), **manifest.model_dump()}
    if args.action == "import":
        source = Path(args.file).expanduser().absolute()
        if not source.is_file():
            raise UserFacingError(f"{source}: no such cache file")
        try:
            return {"action": "import", **compile_cache.import_cache(source)}
        except ValueError as err:
            raise UserFacingError(str(err)) from None
    root = compile_cache.compile_cache_dir()
    return {"action": "status", "cache": str(root), "shapes": compile_cache.known_shapes(root)}
