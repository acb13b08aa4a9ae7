"""The `k6vsr` command line: upscale, plan, demo, archive, gc, serve, server and workers.

Flag names follow SGLang's where they overlap, so its users recognise them. Errors a user can fix (a bad file, a bad
value, a missing model) are printed as one line naming the cause, with exit code 2 and no traceback (unless
`--debug`); nothing half-written is left in the output directory. A service that cannot start (the Prefect server,
the warm workers) is one line too, with exit code 1, as is an internal failure (with its type). The commands that
run flows import them (and Prefect, which takes seconds to import) when they run, so `plan`, `gc` and `--help`
answer at once; every command imports what it needs (the store, media, the model's code) when it runs, so that
`--help` and a refused flag import none of it (tests/test_command_start.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from entrypoints import stopping
from entrypoints.console import configure_terminal, plan_lines, plural, preview_lines, size_text, summary_lines
from entrypoints.devices import check_device, check_device_apart
from entrypoints.flags import input_flags, model_flags, output_flags, request_flags, run_flags, serve_flags, store_flag
from k6vsr_core import status
from k6vsr_core.encoding import SUFFIXES
from k6vsr_core.errors import ParameterError, ServiceError, UserFacingError, describe_error
from k6vsr_core.params import FPS_MODES, UpscaleParams, output_name, parse_params
from k6vsr_core.stage_names import Stage
from runtime import interrupts
from runtime.malloc_arenas import limit_malloc_arenas
from runtime.slots import ARCHIVE_CLIPS_IN_FLIGHT

if TYPE_CHECKING:
    from service.runs import ModelSpec

EXIT_USAGE = 2
EXIT_FAILED = 1


def _upscale_flags(parser: argparse.ArgumentParser) -> None:
    input_flags(parser)
    parser.add_argument(
        "-o",
        "--output-dir",
        "--output-path",
        dest="output_dir",
        default=None,
        help="output folder, or an object-store prefix such as s3://bucket/out/ (default: beside the input)",
    )
    parser.add_argument("--output-file-name", default=None, help="default: <stem>_sr<scale>x_<timestamp>.mp4")
    request_flags(parser)
    model_flags(parser)
    run_flags(parser)


def _plan_flags(parser: argparse.ArgumentParser) -> None:
    input_flags(parser)
    request_flags(parser)
    model_flags(parser)
    store_flag(parser)
    output_flags(parser)


def _preview_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="the video")
    parser.add_argument("--windows", dest="preview_windows", type=int, default=3, help="windows to upscale (default 3)")
    parser.add_argument("-o", "--output-dir", dest="output_dir", default=None, help="default: beside the input")
    request_flags(parser, windows_flag=False)
    model_flags(parser)
    store_flag(parser)
    output_flags(parser)


def _demo_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o", "--output-dir", dest="output_dir", default="k6vsr-demo", help="the demo's clip, model, store and output"
    )
    parser.add_argument("--scale", default="2", help="2, 4 or 2.25")
    output_flags(parser, verbose=True)


def _archive_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input_dir")
    parser.add_argument(
        "-o", "--output-dir", dest="output_dir", required=True, help="the outputs, in the input tree's layout"
    )
    parser.add_argument("--include", action="append", default=None, help="glob of files to take (repeatable)")
    parser.add_argument("--exclude", action="append", default=None, help="glob of files to skip (repeatable)")
    parser.add_argument("--plan", action="store_true", help="write the plan and manifest, run nothing")
    parser.add_argument(
        "--max-parallel",
        type=int,
        default=ARCHIVE_CLIPS_IN_FLIGHT,
        help=f"clips in flight at once (default {ARCHIVE_CLIPS_IN_FLIGHT}: the next clip computes while the one "
        "before it is finished)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace finished outputs")
    request_flags(parser)
    model_flags(parser)
    run_flags(parser)


def _gc_flags(parser: argparse.ArgumentParser) -> None:
    store_flag(parser)
    parser.add_argument("--keep-outputs", action="store_true", help="keep each run's muxed output and manifest")
    parser.add_argument(
        "--older-than-hours", type=float, default=0.0, help="only runs last touched longer ago than this"
    )
    parser.add_argument("--dry-run", action="store_true", help="say what would be reclaimed, delete nothing")
    output_flags(parser)


def _service_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("start", "stop", "status"))
    output_flags(parser)


def _server_flags(parser: argparse.ArgumentParser) -> None:
    _service_flags(parser)
    parser.add_argument(
        "--database",
        metavar="URL",
        default=None,
        help="start: keep the history in this PostgreSQL database (postgresql+asyncpg://USER:PASSWORD@HOST:PORT/DB), "
        "or 'sqlite' (the default: a file in the state folder); remembered for later starts. Default: Prefect's "
        "PREFECT_SERVER_DATABASE_CONNECTION_URL when set, else the database of the last start",
    )
    parser.add_argument(
        "--secondary",
        action="store_true",
        help="start: a further API server on a PostgreSQL database another server already serves; it leaves the "
        "database-wide services (scheduler, late runs, ...) to that one",
    )


def _workers_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("start", "stop", "status"))
    parser.add_argument("-n", "--workers", type=int, default=0, help="CPU workers to start (default: one per GPU)")
    parser.add_argument("--gpus", action="store_true", help="one worker per GPU (the default when GPUs are found)")
    model_flags(parser, at_start=True)
    output_flags(parser)


def _cache_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("export", "import", "status"))
    parser.add_argument("file", nargs="?", default=None, help="the cache file (export, import)")
    output_flags(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k6vsr", description="Kandinsky 6.0 video super-resolution, resumable.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.help, **command.parser_options)
        command.flags(sub)
        # Looked up now, not when the table was made: a test may replace a handler.
        sub.set_defaults(handler=globals()[f"cmd_{name}"], show=command.show)
    return parser


def params_from(args: argparse.Namespace) -> UpscaleParams:
    given = {name: getattr(args, name) for name in UpscaleParams.model_fields if hasattr(args, name)}
    if getattr(args, "latent", None) is not None:
        given.pop("fps_mode", None)  # --fps is the latent's rate (`input_from`), not a request field
    try:
        return parse_params(**given)
    except ParameterError as err:
        raise ParameterError(f"invalid request: {err}") from None


def input_from(args: argparse.Namespace) -> tuple[Path, str | None]:
    """The run's input and, for a latent, its frame rate: the video, or `--latent FILE` with `--fps RATE`. `--fps`
    keeps its words for a video and takes a rate with `--latent`; anything else is refused here, before any work."""
    video, latent = args.input, getattr(args, "latent", None)
    fps = getattr(args, "fps_mode", None)
    if video is not None and latent is not None:
        raise ParameterError("give a video or --latent FILE.safetensors, not both")
    if latent is None:
        if video is None:
            raise ParameterError("give a video to upscale, or --latent FILE.safetensors with --fps RATE")
        if fps is not None and fps not in FPS_MODES:
            raise ParameterError(
                f"--fps {fps}: a video's --fps is contract or source; a frame rate is given only with --latent"
            )
        return Path(video).expanduser().absolute(), None  # not resolved: a link's name names the output
    if fps is None:
        raise ParameterError("--latent needs --fps RATE, the latent's frame rate (e.g. 24 or 30000/1001)")
    if fps in FPS_MODES:
        raise ParameterError(f"--fps {fps}: with --latent, --fps is the latent's frame rate (e.g. 24 or 30000/1001)")
    return Path(latent).expanduser().absolute(), fps


def model_from(args: argparse.Namespace) -> ModelSpec:
    from service.runs import ModelSpec

    return ModelSpec(
        model=_absolute_if_local(args.model),
        revision=args.revision,
        model_id=args.model_id,
        device=getattr(args, "device", "auto"),
        compile=getattr(args, "compile", True),
        memory=args.memory,
    )


def _absolute_if_local(model: str) -> str:
    """An existing local folder as an absolute path, as every path leaving the command: warm workers and job
    processes resolve paths in their own working folder. A hub repo id stays as it is."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def store_from(args: argparse.Namespace) -> str | Path:
    """`--store`: a folder (made absolute) or an object-store URL (`s3://bucket/prefix`); else K6VSR_STORE or the
    cache folder."""
    from storage import default_store_root, parse_store_root

    if not getattr(args, "store", None):
        return default_store_root()
    root = parse_store_root(args.store)
    return root.resolve() if isinstance(root, Path) else root


# Refuse an output folder with less free space than this plus a generous guess of the output's size.
MIN_FREE_BYTES = 1 << 20


def _check_output_dir(path: Path, needed_bytes: int = 0) -> None:
    if path.exists() and not path.is_dir():
        raise UserFacingError(f"output directory {path} is a file")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserFacingError(f"output directory {path} cannot be created: {err.strerror}") from None
    if not os.access(path, os.W_OK):
        raise UserFacingError(f"output directory {path} is not writable")
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return
    if free < needed_bytes + MIN_FREE_BYTES:
        raise UserFacingError(
            f"output directory {path} is on a full disk: {free} bytes free, about "
            f"{needed_bytes + MIN_FREE_BYTES} needed; free some space and rerun"
        )


def _check_output_file(destination: Path, source: Path) -> None:
    if destination.is_dir():
        raise UserFacingError(f"output file {destination} is a directory")
    if destination.exists() and source.exists() and os.path.samefile(destination, source):
        raise UserFacingError(f"output file {destination} is the input file; pick another name or folder")


def _estimated_output_bytes(plan: Any) -> int:
    """An upper guess of the MP4's size: an eighth of the raw RGB frames (H.264 at CRF 18 stays far below)."""
    height, width = plan.delivery_size
    return plan.num_frames * height * width * 3 // 8


@contextmanager
def local_input(args: argparse.Namespace) -> Iterator[tuple[argparse.Namespace, str | None]]:
    """The arguments with a source URL (video or `--latent`) replaced by a download of it, and the URL: the object is
    fetched once into a private folder, removed when the block ends, and read as that file (same bytes, same run
    key)."""
    from storage.urls import fetch_source, is_url

    url = next((given for given in (args.input, getattr(args, "latent", None)) if given and is_url(given)), None)
    if url is None:
        yield args, None
        return
    with tempfile.TemporaryDirectory(prefix="k6vsr-source-") as folder:
        local = str(fetch_source(url, Path(folder)))
        field = "input" if args.input == url else "latent"
        yield argparse.Namespace(**{**vars(args), field: local}), url


def check_request(args: argparse.Namespace) -> None:
    """The input and request flags, checked as the run checks them (in that order) but before a source URL is
    fetched or the store's code imported: a refused flag answers at once."""
    input_from(args)
    params_from(args)


def cmd_upscale(args: argparse.Namespace) -> dict[str, Any]:
    check_request(args)
    with local_input(args) as (local, url):
        result = _upscale(local, url)
    return {**result, "source": url} if url else result


def _upscale(args: argparse.Namespace, source_url: str | None) -> dict[str, Any]:
    from entrypoints.progress_bars import run_progress
    from service.runs import model_info, prepare_run

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
    from storage.urls import check_output_prefix, is_url, url_parent

    name = output_file_name(args.output_file_name or output_name(source, params, datetime.now()), params)
    given = args.output_dir or (url_parent(source_url) if source_url else None)
    if given and is_url(given):
        check_output_prefix(given)
        destination = f"{given.rstrip('/')}/{name}"
        if destination == source_url:
            raise UserFacingError(f"output {destination} is the input; pick another name or prefix")
        return destination
    out_dir = Path(given).expanduser().resolve() if given else source.resolve().parent
    _check_output_dir(out_dir, _estimated_output_bytes(plan))
    _check_output_file(out_dir / name, source)
    return str(out_dir / name)


def output_file_name(name: str, params: UpscaleParams) -> str:
    """The name with the container's suffix added; a name with another container's suffix is refused."""
    suffix = params.encoding.suffix
    if any(name.lower().endswith(other) for other in SUFFIXES if other != suffix):
        raise ParameterError(
            f"--output-file-name {name!r}: codec {params.codec} is written as {suffix[1:].upper()}; name it {suffix}"
        )
    return name if name.lower().endswith(suffix) else name + suffix


def cmd_preview(args: argparse.Namespace) -> dict[str, Any]:
    if args.preview_windows < 1:
        raise ParameterError(f"--windows {args.preview_windows}: a preview needs at least one window")
    from service.runs import model_info, prepare_run

    source = Path(args.input).expanduser().absolute()
    spec = model_from(args)
    prepared = prepare_run(source, params_from(args), spec, store_from(args), tensors=False)
    out_dir = Path(args.output_dir).expanduser().resolve() if args.output_dir else source.resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    model_info(spec)
    check_device(spec.device)
    from entrypoints.progress_bars import run_progress
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
    import psutil

    return psutil.Process().create_time()


def cmd_plan(args: argparse.Namespace) -> dict[str, Any]:
    check_request(args)
    with local_input(args) as (local, url):
        planned = _plan(local)
    return {**planned, "source": url} if url else planned


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    from k6vsr_core.bundle import weights_present
    from service.runs import prepare_run
    from storage.estimate import store_estimate

    source, latent_fps = input_from(args)
    # From the model's configs alone: a plan loads no model, so it needs no weight files (nor their download).
    prepared = prepare_run(source, params_from(args), model_from(args), store_from(args), latent_fps, weights=False)
    plan = prepared.plan
    grid = plan.grid
    return {
        "source": prepared.source,
        **_source_facts(prepared),
        "frames_kept": plan.num_frames,
        "fps": plan.fps,
        "interlacing": plan.interlacing(),
        "timing": plan.frame_timing(),
        "output_format": plan.output_format(),
        "window_mode": plan.params.windows,
        "cuts": list(plan.cuts),
        "windows": _windows_of(plan),
        "shots": _shots_of(plan),
        "tiles_per_window": plan.num_tiles,
        "items": progress_of(prepared),
        "store_estimate": store_estimate(plan).model_dump(),
        "run_estimate": _run_estimate(prepared),
        "padding": {"bottom": grid.padding[0], "right": grid.padding[1]},
        "tile": {"base": list(grid.base), "lr": list(grid.tile), "tops": list(grid.tops), "lefts": list(grid.lefts)},
        "tiles": plan.num_tiles,
        "chunks": [{"tiles": list(c.tiles), "seed": c.seed} for c in plan.chunks],
        "dit_steps_per_tile": plan.steps,
        "sr_size": {"width": plan.sr_size[1], "height": plan.sr_size[0]},
        "output_size": {"width": plan.delivery_size[1], "height": plan.delivery_size[0]},
        "aspect": plan.aspect(),
        "model": prepared.model_info.identity,
        "model_weights_present": weights_present(Path(prepared.model_info.path)),
        "run_key": prepared.run.run_key,
        "finished_run_exists": prepared.finished,
    }


def _windows_of(plan: Any) -> list[dict[str, Any]]:
    return [
        {
            "window": w.index,
            "frames": [w.start, w.stop],
            "computed_as": w.padded,
            "overlap_before": plan.windows[w.index - 1].stop - w.start if w.index else 0,
            "segment": list(plan.segment_range(w.index)),
            "seeds": [c.seed for c in plan.chunks],
        }
        for w in plan.windows
    ]


def _shots_of(plan: Any) -> list[dict[str, Any]]:
    """What happens to each shot: a shot shorter than a window is one window of its own, padded as a short clip is
    (`computed_as` frames, cropped back); every shot meets the next at a hard cut, never a cross-fade."""
    from k6vsr_core.windows import WINDOW_FRAMES, plan_shots

    shots = []
    for shot in plan_shots(plan.windows, plan.cuts):
        short = shot.frames < WINDOW_FRAMES
        shots.append(
            {
                "shot": shot.index,
                "frames": [shot.start, shot.stop],
                "windows": list(shot.windows),
                "short": short,
                "computed_as": plan.windows[shot.windows[0]].padded if short else None,
                "joined_by": None if shot.index == 0 else "hard cut",
            }
        )
    return shots


def _run_estimate(prepared: Any) -> dict[str, Any] | None:
    """The whole run's time and disk from the rates a preview of this run measured (`k6vsr preview`); None
    without one."""
    from storage.estimate import run_estimate

    estimate = run_estimate(prepared.run.open(), prepared.plan)
    return None if estimate is None else estimate.model_dump()


def _source_facts(prepared: Any) -> dict[str, Any]:
    """What the input is: a video's probe, or a latent's pixel size, frames and rate (as its plan reads them)."""
    if prepared.probe is None:
        plan = prepared.plan
        return {
            "source_size": {"width": plan.source_size[1], "height": plan.source_size[0]},
            "source_frames": plan.source_frames,
            "source_fps": plan.source_fps,
            "latent_fps": prepared.latent_fps,
        }
    probe = prepared.probe
    return {
        "source_size": {"width": probe.width, "height": probe.height},
        "source_frames": probe.num_frames,
        "source_fps": probe.fps,
        "source_colour": f"{probe.colour.describe()}, {probe.bit_depth}-bit",
    }


def progress_of(prepared: Any) -> dict[str, int]:
    """The (window, tile) items a run of this plan has already finished, from the run store."""

    plan = prepared.plan
    store = prepared.run.open()
    return {
        "total": plan.num_windows * plan.num_tiles,
        "denoised": len(store.records.items(Stage.DENOISE)),
        "decoded": store.tiles_decoded(),
        "windows_blended": len(store.records.items(Stage.BLEND)),
        "segments": len(store.records.items(Stage.SEGMENT)),
        "output": int(store.output_done()),
    }


def cmd_demo(args: argparse.Namespace) -> dict[str, Any]:
    status.say("loading Prefect and torch")  # seconds, before the bar can show
    from entrypoints.demo import run_demo

    return run_demo(Path(args.output_dir), params_from(argparse.Namespace(scale=args.scale)), quiet=args.json)


def cmd_gc(args: argparse.Namespace) -> dict[str, Any]:
    from storage import collect_garbage

    report = collect_garbage(store_from(args), args.keep_outputs, args.older_than_hours * 3600, dry_run=args.dry_run)
    reclaimed = sum(r["bytes"] for r in report if r["deleted"])
    return {"runs": report, "bytes_reclaimed": reclaimed, "dry_run": args.dry_run}


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
    _check_output_dir(output_dir)
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


def cmd_archive(args: argparse.Namespace) -> dict[str, Any]:
    result = run_archive_command(args, params_from(args), model_from(args), store_from(args))
    return {**result, "plan_only": bool(args.plan)}


def cmd_serve(args: argparse.Namespace) -> dict[str, Any]:
    from entrypoints.server.app import serve

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


def cmd_server(args: argparse.Namespace) -> dict[str, Any]:
    """`k6vsr server start|stop|status`: the local server, whatever `PREFECT_API_URL` says (status names it)."""
    from runtime import flow_leases, prefect_api, prefect_server

    if args.action != "start" and (args.database is not None or args.secondary):
        raise UserFacingError(f"--database and --secondary go with `k6vsr server start`, not {args.action}")
    if args.action == "start":
        # --secondary alone keeps the remembered database; --database alone makes a primary server.
        secondary = args.secondary if args.database is not None or args.secondary else None
        flow_leases.mark_crashed_runs(prefect_server.start_server(database=args.database, secondary=secondary))
    elif args.action == "stop":
        was_running = prefect_server.stop_server()
        return {**prefect_server.server_status().model_dump(mode="json"), "stopped": was_running}
    status = prefect_server.server_status()
    # The runs that commands report to: those of PREFECT_API_URL when it is set, else the local server's.
    url = prefect_api.configured_api_url() or (status.url if status.running else None)
    if url:
        flow_leases.mark_crashed_runs(url)
    return status.model_dump(mode="json")


def cmd_workers(args: argparse.Namespace) -> dict[str, Any]:
    """`k6vsr workers start|stop|status`: the warm workers (runtime.warm_workers)."""
    from runtime import warm_workers
    from service.runs import model_info

    if args.action == "start":
        gpus = args.gpus or (args.workers == 0 and bool(warm_workers.gpu_ids()))
        if args.workers < 0:
            raise UserFacingError(f"-n must be at least 1, not {args.workers}")
        spec = model_from(args).model_dump_json() if args.model else None
        if args.model:
            model_info(model_from(args))  # a missing or broken model fails here, in one line
        warm_workers.start_workers(args.workers, gpus=gpus, model_json=spec)
    elif args.action == "stop":
        was_running = warm_workers.stop_workers()
        return {**warm_workers.workers_status().model_dump(mode="json"), "stopped": was_running}
    return warm_workers.workers_status().model_dump(mode="json")


def cmd_cache(args: argparse.Namespace) -> dict[str, Any]:
    """`k6vsr cache export|import|status [FILE]`: PyTorch's cache artefacts of the kernels compiled here."""
    from k6vsr_core import compile_cache

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


def _print_cache(result: dict[str, Any]) -> None:
    if result["action"] == "export":
        print(f"wrote {result['file']}: {len(result['artifacts'])} artefact files, {len(result['shapes'])} shapes")
        print(f"  for torch {result['torch']} on {result['device'] or 'no GPU'}")
    elif result["action"] == "import":
        print(f"imported {result['file']} into {result['cache']}: {len(result['shapes'])} shapes")
    else:
        print(f"compile cache: {result['cache']}")
        for shape in result["shapes"] or ["no shape compiled on this machine yet"]:
            print(f"  {shape}")


def _print_workers(result: dict[str, Any]) -> None:
    if "stopped" in result:
        print("stopped the warm workers" if result["stopped"] else "no warm workers were running")
    elif result["running"]:
        up = f"supervisor pid {result['pid']}, up {result['uptime_s']:.0f} s"
        print(f"warm workers running at {result['address']}: {up}")
        for worker in result["workers"]:
            gpu = f" GPU {worker['gpu']}" if worker["gpu"] is not None else ""
            models = ", ".join(worker["models"]) or "no model loaded"
            print(f"  {worker['name']}: pid {worker['pid']}{gpu}, {models} ({worker['loads']} loads)")
        if result.get("dashboard"):
            print(f"  dashboard: {result['dashboard']}")
    else:
        print("warm workers not running (k6vsr workers start); commands run tiles in their own process")
    print(f"  home: {result['home']}")


def _print_server(result: dict[str, Any]) -> None:
    if "stopped" in result:
        print("stopped the local Prefect server" if result["stopped"] else "no local Prefect server was running")
    elif result["running"]:
        print(f"local Prefect server running: pid {result['pid']}, up {result['uptime_s']:.0f} s")
        print(f"  UI:  {result['ui_url']}")
        print(f"  API: {result['url']}")
    else:
        print("local Prefect server not running (the next command that runs a flow starts it)")
    if result.get("database"):
        role = " (secondary: the database-wide services run on another server)" if result["secondary"] else ""
        print(f"  database: {result['database']}{role}")
    print(f"  home: {result['home']}")
    if result.get("external_api_url"):
        print(f"  note: PREFECT_API_URL is set; commands report to {result['external_api_url']}")


def _print_lines(lines: Callable[[dict[str, Any]], list[str]]) -> Callable[[dict[str, Any]], None]:
    return lambda result: print("\n".join(lines(result)))


def _print_demo(result: dict[str, Any]) -> None:
    print("\n".join([*summary_lines(result), result["next"]]))


def _print_gc(result: dict[str, Any]) -> None:
    verb = "would reclaim" if result["dry_run"] else "reclaimed"
    runs = plural(sum(r["deleted"] for r in result["runs"]), "run")
    print(f"{verb} {size_text(result['bytes_reclaimed'])} from {runs}")
    for run in result["runs"]:
        what = f"{run['reason']}, {size_text(run['bytes'])}"
        print(f"  {'' if run['deleted'] else 'kept '}{run['run_key']}: {what}")


def _print_archive(result: dict[str, Any]) -> None:
    # Every clip of a plan; of a run, each file that failed or was skipped, with its cause.
    for row in result.get("rows", []):
        if result.get("plan_only") or row.get("status") in ("failed", "skipped"):
            reason = (row.get("reason") or "").removeprefix(f"{row.get('source')}: ")  # the row names the file
            print(f"  {row.get('status', ''):>8}  {row.get('relative_path', '')}  {reason}")
    print(result.get("message") or "nothing to do")  # the counts, once
    print(f"manifest: {result.get('manifest_json')}")


@dataclass(frozen=True)
class Command:
    """A `k6vsr` command: its help, its flags and how its result is printed; `cmd_<name>` runs it."""

    help: str
    flags: Callable[[argparse.ArgumentParser], None]
    show: Callable[[dict[str, Any]], None] | None  # None: nothing to print (`serve` runs until stopped)
    parser_options: dict[str, Any] = field(default_factory=dict)


COMMANDS = {
    "upscale": Command("upscale one clip", _upscale_flags, _print_lines(summary_lines)),
    "plan": Command("print what a run would do, without loading a model", _plan_flags, _print_lines(plan_lines)),
    "preview": Command(
        "upscale a few representative windows first: a side-by-side MP4, a contact sheet, an estimate",
        _preview_flags,
        _print_lines(preview_lines),
    ),
    "demo": Command(
        "run the whole pipeline on a synthetic clip with a tiny random model (k6vsr-demo/tiny-bundle), which every "
        "command takes with --model on a machine without a GPU",
        _demo_flags,
        _print_demo,
    ),
    "archive": Command("upscale every clip of a folder tree", _archive_flags, _print_archive),
    "gc": Command("reclaim the disk of finished or abandoned runs", _gc_flags, _print_gc),
    "server": Command(
        "the local Prefect server that keeps every run's history (started by any command that needs it)",
        _server_flags,
        _print_server,
    ),
    "workers": Command(
        "warm Dask workers that keep models loaded across runs (used by every command while they run)",
        _workers_flags,
        _print_workers,
    ),
    "cache": Command(
        "the compiled-kernel cache: export it to a file, import one (a fleet compiles once), or show it",
        _cache_flags,
        _print_cache,
    ),
    "serve": Command(
        "SGLang-compatible HTTP job API (/v1/videos)",
        serve_flags,
        None,
        {"formatter_class": argparse.ArgumentDefaultsHelpFormatter},
    ),
}


def unexpected_error(err: BaseException) -> str:
    """An error no rule describes, in words that always name a cause: its message, else the message of the error
    it came from, else where it was raised (a bare `TimeoutError()` from a library said nothing at all)."""
    name = type(err).__name__
    if str(err).strip():
        return f"{name}: {err}"
    seen: set[int] = {id(err)}
    inner = err.__cause__ or err.__context__
    while inner is not None and id(inner) not in seen:
        if str(inner).strip():
            return f"{name}, from {type(inner).__name__}: {inner}"
        seen.add(id(inner))
        inner = inner.__cause__ or inner.__context__
    frames = traceback.extract_tb(err.__traceback__)
    if frames:
        last = frames[-1]
        return f"{name} (no message) raised in {last.name} at {Path(last.filename).name}:{last.lineno}"
    return f"{name} (no message)"


def _error_exit(err: Exception) -> int:
    """The one line an error is, and the exit code: a service's or an internal failure 1, the user's 2."""
    if isinstance(err, ServiceError):  # the server or the workers: not the user's doing, but said in one line
        print(f"k6vsr: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    message = describe_error(err)
    if message is None:
        print(f"k6vsr: error: {unexpected_error(err)} (rerun with --debug for details)", file=sys.stderr)
        return EXIT_FAILED
    print(f"k6vsr: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _print_result(args: argparse.Namespace, result: dict[str, Any]) -> int:
    try:
        if getattr(args, "json", False):
            print(json.dumps(result, indent=2))
        else:
            args.show(result)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (`k6vsr workers status | head -1`): no traceback. Python flushes stdout again at exit,
        # so it is pointed at /dev/null; the exit code is Python's advice for this case.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    return EXIT_FAILED if result.get("failed") else 0


def main(argv: Sequence[str] | None = None) -> int:
    limit_malloc_arenas()  # before any thread of the command starts
    args = build_parser().parse_args(argv)
    configure_terminal(verbose=args.debug or getattr(args, "verbose", False))
    try:
        with stopping.stop_on_interrupt():
            result = args.handler(args)
    except (KeyboardInterrupt, interrupts.Interrupted) as err:  # outside a flow; inside one the flow stops first
        stopping.stop(interrupts.signal_of(err) or signal.SIGINT)
    except Exception as err:  # noqa: BLE001 - turned into one clear line
        if args.debug:
            raise
        return _error_exit(err)
    return 0 if args.show is None else _print_result(args, result)


if __name__ == "__main__":
    sys.exit(main())
