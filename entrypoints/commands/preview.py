"""`k6vsr preview`: a few representative windows of a clip, a side-by-side MP4, a contact sheet and an estimate."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import psutil

from entrypoints.command_inputs import model_from, store_from
from entrypoints.devices import check_device
from entrypoints.progress_bars import run_progress
from entrypoints.request_inputs import params_from
from k6vsr_core.errors import ParameterError
from service.runs import model_info, prepare_run


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.preview_windows < 1:
        raise ParameterError(f"--windows {args.preview_windows}: a preview needs at least one window")

    source = Path(args.input).expanduser().absolute()
    spec = model_from(args)
    prepared = prepare_run(source, params_from(args), spec, store_from(args), tensors=False)
    out_dir = Path(args.output_dir).expanduser().resolve() if args.output_dir else source.resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    model_info(spec)
    check_device(spec.device)
    from flows.orchestrate import prefect_api, tile_runner
    from flows.preview import preview_clip

    # A bar from the start: the model's load and its first windows take minutes on a CPU, and said nothing.
    with prefect_api(), run_progress(prepared, enabled=not args.json, time_left=False):
        summary = preview_clip.with_options(task_runner=tile_runner(spec))(
            prepared=prepared,
            model=spec,
            count=args.preview_windows,
            out_dir=str(out_dir),
            command_started=_command_started(),
        )
    return summary.model_dump(mode="json")


def _command_started() -> float:
    """When this command's process began (wall clock): its imports count, as they do for every command the user runs."""
    return psutil.Process().create_time()
