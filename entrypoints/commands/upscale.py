"""`k6vsr upscale`: one clip, planned first, so that a bad file, value or model fails before a server starts or a
model loads; Prefect and the flows (seconds to import) after it, with a line saying so."""

from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path
from typing import Any

from entrypoints.command_inputs import (
    check_output_dir,
    check_output_file,
    estimated_output_bytes,
    local_input,
    model_from,
    store_from,
)
from entrypoints.devices import check_device
from entrypoints.progress_bars import run_progress
from entrypoints.request_inputs import input_from, params_from
from k6vsr_core import status
from k6vsr_core.contract.params import UpscaleParams, output_name
from k6vsr_core.errors import ParameterError, UserFacingError
from k6vsr_core.media.encoding import SUFFIXES
from service.runs import model_info, prepare_run
from storage.urls import check_output_prefix, is_url, url_parent


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Its request was checked (`entrypoints.request_inputs.check_request`) before this module was imported."""
    with local_input(args) as (local, url):
        result = _upscale(local, url)
    return {**result, "source": url} if url else result


def _upscale(args: argparse.Namespace, source_url: str | None) -> dict[str, Any]:
    source, latent_fps = input_from(args)
    params = params_from(args)
    spec = model_from(args)
    store = store_from(args)
    # Plan first: a bad file, value or model fails here, before a server starts or a model loads, and before
    # Prefect is imported (seconds). The weights are checked against the architecture where the model loads.
    prepared = prepare_run(source, params, spec, store, latent_fps, tensors=False)
    status.say("loading Prefect")  # seconds, before the bar can show
    from flows.orchestrate import run_clip, tile_runner
    from runtime.runners import resolve_address

    # With warm workers (or a cluster given), they hold the model and the devices: this process only plans and
    # submits, and never imports torch (seconds). Otherwise its own threads compute, and it checks both now.
    address = resolve_address(args.workers, args.gpus, args.dask_address)
    if address is None:
        status.say("loading torch")
        model_info(spec)
        check_device(spec.device)
    destination = _destination(args, source, source_url, params, prepared.plan)
    with run_progress(prepared, enabled=not args.json):
        runner = tile_runner(spec, prepared, args.workers, args.gpus, address)
        summary = run_clip(prepared, destination, spec, runner).summary()
    return summary.model_dump(mode="json")


def _destination(
    args: argparse.Namespace, source: Path, source_url: str | None, params: UpscaleParams, plan: Any
) -> str:
    """The output's path or URL, checked: beside the source by default (in its prefix for a source URL)."""

    name = output_file_name(args.output_file_name or output_name(source, params, datetime.now()), params)
    given = args.output_dir or (url_parent(source_url) if source_url else None)
    if given and is_url(given):
        check_output_prefix(given)
        destination = f"{given.rstrip('/')}/{name}"
        if destination == source_url:
            raise UserFacingError(f"output {destination} is the input; pick another name or prefix")
        return destination
    out_dir = Path(given).expanduser().resolve() if given else source.resolve().parent
    check_output_dir(out_dir, estimated_output_bytes(plan))
    check_output_file(out_dir / name, source)
    return str(out_dir / name)


def output_file_name(name: str, params: UpscaleParams) -> str:
    """The name with the container's suffix added; a name with another container's suffix is refused."""
    suffix = params.encoding.suffix
    if any(name.lower().endswith(other) for other in SUFFIXES if other != suffix):
        raise ParameterError(
            f"--output-file-name {name!r}: codec {params.codec} is written as {suffix[1:].upper()}; name it {suffix}"
        )
    return name if name.lower().endswith(suffix) else name + suffix
