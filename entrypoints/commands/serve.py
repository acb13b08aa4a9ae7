"""`k6vsr serve`: the HTTP job API."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from entrypoints.command_inputs import model_from, store_from
from entrypoints.devices import check_device_apart
from entrypoints.server.app import serve
from k6vsr_core.errors import UserFacingError


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = model_from(args)
    store = store_from(args)
    if args.jobs_dir:
        jobs_dir = Path(args.jobs_dir).expanduser().resolve()
    elif isinstance(store, Path):
        jobs_dir = store
    else:
        # Uploads arrive on this machine and the job records are rewritten under a lock: they stay on its disk.
        raise UserFacingError(
            f"--store {store} is an object store: give the server a folder of its own for the job records, inputs "
            "and outputs with --jobs-dir"
        )
    check_device_apart(spec.device)  # the server's own process never imports torch
    serve(args, spec, jobs_dir, run_root=store)
    return {}
