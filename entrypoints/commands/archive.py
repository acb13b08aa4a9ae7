"""`k6vsr archive`: every clip of a folder tree, as one archive flow run."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from entrypoints.command_inputs import check_output_dir, model_from, store_from
from entrypoints.request_inputs import params_from
from k6vsr_core import status
from k6vsr_core.errors import UserFacingError


def _archive_folders(args: argparse.Namespace) -> tuple[Path, Path]:
    """The archive's input and output folders, checked before anything starts."""
    source = Path(args.input_dir).expanduser().resolve()
    if not source.exists():
        raise UserFacingError(f"input {args.input_dir} does not exist")
    if args.max_parallel < 1:
        raise UserFacingError(f"--max-parallel must be at least 1, not {args.max_parallel}")
    output_dir = Path(args.output_dir).expanduser().resolve()
    if output_dir == source:
        raise UserFacingError(f"the output folder {args.output_dir} is the input folder; choose another one")
    check_output_dir(output_dir)
    return source, output_dir


def run_archive_command(args: argparse.Namespace, params: Any, spec: Any, store_root: str | Path) -> dict[str, Any]:
    """`k6vsr archive`: check the input, output and model first, then run the archive flow and return its summary,
    which its final state carries whether it completed or failed (some clips failed)."""
    status.say("loading Prefect")  # seconds, before the bars can show
    from entrypoints.progress_bars import archive_progress
    from flows.archive.report import MANIFEST_NAME
    from flows.archive.rows import ArchiveSummary
    from flows.orchestrate import prefect_api
    from flows.upscale_archive import upscale_archive
    from service.runs import model_info

    source, output_dir = _archive_folders(args)
    model_info(spec)  # a missing or broken model fails here, in one line, before any server starts
    # One API for every clip flow and worker: the configured one, else the local server (started if absent).
    progress = archive_progress(output_dir / f"{MANIFEST_NAME}.json", args.max_parallel, enabled=not args.json)
    with progress, prefect_api():
        state = upscale_archive(
            input_dir=str(source),
            output_dir=str(output_dir),
            params=params,
            model=spec,
            store_root=str(store_root),
            include=args.include,
            exclude=args.exclude,
            max_parallel=args.max_parallel,
            overwrite=args.overwrite,
            plan_only=args.plan,
            workers=args.workers,
            gpus=args.gpus,
            dask_address=args.dask_address,
            return_state=True,
        )
    outcome = state.result(raise_on_failure=False)
    if isinstance(outcome, ArchiveSummary):
        return outcome.model_dump(mode="json")
    if isinstance(outcome, BaseException):
        raise outcome
    raise RuntimeError(f"the archive flow ended {state.name}: {state.message}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    result = run_archive_command(args, params_from(args), model_from(args), store_from(args))
    return {**result, "plan_only": bool(args.plan)}
