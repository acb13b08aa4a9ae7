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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from entrypoints import stopping
from entrypoints.console import configure_terminal, plan_lines, plural, preview_lines, size_text, summary_lines
from k6vsr_core import status
from k6vsr_core.errors import ArchiveFailed, ParameterError, ServiceError, UserFacingError, describe_error
from k6vsr_core.memory_modes import MEMORY_MODES
from k6vsr_core.params import FPS_MODES, UpscaleParams, output_name, parse_params
from k6vsr_core.release_config import DEFAULT_MODEL
from runtime import interrupts
from runtime.slots import ARCHIVE_CLIPS_IN_FLIGHT

if TYPE_CHECKING:
    from service.runs import ModelSpec

EXIT_USAGE = 2
EXIT_FAILED = 1


def _model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default=os.environ.get("K6VSR_MODEL", DEFAULT_MODEL),
        help="Hugging Face repo id or local folder in the Diffusers layout (env K6VSR_MODEL)",
    )
    group.add_argument("--revision", default=None, help="hub revision (default: the pinned release revision)")
    group.add_argument(
        "--model-id",
        default=None,
        help="identity of a local copy (e.g. the repo id it came from), so its runs are shared",
    )
    group.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    group.add_argument(
        "--memory",
        default="auto",
        choices=MEMORY_MODES,
        help="GPU memory budget: auto (default: the fastest that fits the clip on the GPU's memory), "
        + " or ".join(", ".join(MEMORY_MODES[1:]).rsplit(", ", 1)),
    )
    group.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CUDA, compile the DiT blocks and the KVAE decoder (default); --no-compile runs them eagerly "
        "(NABLA's flex attention is compiled either way). Kernels are cached per machine: see `k6vsr cache`",
    )


def _param_flags(parser: argparse.ArgumentParser, windows_flag: bool = True) -> None:
    """The request flags. A flag not given is left out, so the request takes `UpscaleParams`' (official) default.
    `k6vsr preview` takes `--windows N` for its window count: there the mode is `--window-mode` only."""
    defaults = UpscaleParams()
    group = parser.add_argument_group("request", argument_default=argparse.SUPPRESS)
    group.add_argument(
        "--scale", "--sr-resolution-scale", dest="scale", help=f"2, 2.25 or 4 (default {defaults.scale_label})"
    )
    group.add_argument("--num-inference-steps", type=int, help="DiT evaluations per tile (default: the checkpoint's)")
    group.add_argument("--seed", type=int, help=f"noise seed (default {defaults.seed})")
    group.add_argument(
        "--tiles-batch-size",
        "--sr-tiles-batch-size",
        dest="tiles_batch_size",
        type=int,
        help=f"tiles denoised together (default {defaults.tiles_batch_size})",
    )
    group.add_argument(
        "--tile-min-overlap",
        "--sr-tile-min-overlap",
        dest="min_overlap",
        type=float,
        help=f"minimum tile overlap (default {defaults.min_overlap})",
    )
    group.add_argument(
        "--target-resolution",
        "--sr-target-resolution",
        dest="target_resolution",
        help="none, hd, fullhd, 2k or WxH (default none)",
    )
    group.add_argument(
        "--target-resize-mode",
        "--sr-target-resize-mode",
        dest="target_resize_mode",
        help=f"fit or exact (default {defaults.target_resize_mode})",
    )
    group.add_argument("--attention", help=f"nabla or dense (default {defaults.attention}, as released)")
    group.add_argument(
        "--frames",
        help=f"all (every kept frame, in 121-frame windows) or contract (the first 121) (default {defaults.frames})",
    )
    group.add_argument("--max-frames", type=int, help="with --frames all: only the first N kept frames (a preview)")
    group.add_argument("--codec", help=f"h264, hevc or ffv1 (lossless, in .mkv) (default {defaults.codec})")
    group.add_argument("--crf", type=int, help="h264/hevc quality, 0 (best) to 51 (default 18)")
    group.add_argument("--preset", help="h264/hevc speed preset, ultrafast to placebo (default: the encoder's, medium)")
    group.add_argument(
        "--pix-fmt", dest="pix_fmt", help="yuv420p, yuv420p10le or yuv444p (default yuv420p; ffv1: lossless RGB)"
    )
    group.add_argument(
        "--audio",
        help="contract (mono 44.1 kHz AAC), original (every audio and subtitle stream as is), none, or an audio "
        f"file to mix in (default {defaults.audio})",
    )
    group.add_argument(
        "--fps",
        dest="fps_mode",
        metavar="MODE_OR_RATE",
        help="a video: contract (the 24-fps rule) or source (every frame at the exact source rate; out of contract) "
        f"(default {defaults.fps_mode}); with --latent: the latent's frame rate, e.g. 24 or 30000/1001 (required)",
    )
    group.add_argument(
        "--window-overlap",
        type=int,
        help=f"frames shared by neighbouring windows, at least (default {defaults.window_overlap})",
    )
    group.add_argument(
        *(("--windows", "--window-mode") if windows_flag else ("--window-mode",)),
        dest="windows",
        help="even (windows spread over the clip) or scenes (windows within each shot, none across a scene cut; "
        f"the source is decoded once more to find them) (default {defaults.windows})",
    )


def _input_args(parser: argparse.ArgumentParser) -> None:
    """A video, or a latent: exactly one of them (`input_from`)."""
    parser.add_argument(
        "input", nargs="?", default=None, help="the video, a file or an object-store URL (or give --latent instead)"
    )
    parser.add_argument(
        "--latent",
        default=None,
        metavar="FILE.safetensors",
        help="instead of a video: one unscaled KVAE latent [T, C, H, W] (FastVideo's sr_lr_latent), with --fps RATE; "
        "scale 2 or 4; silent unless --audio FILE",
    )


def _run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default=None, help="run store root (env K6VSR_STORE; default: per-user cache)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes for tiles (default 1: in-process)")
    parser.add_argument("--gpus", action="store_true", help="one Dask worker per GPU")
    parser.add_argument("--dask-address", default=None, help="run tiles on an existing Dask scheduler")
    parser.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    parser.add_argument("--verbose", action="store_true", help="show every task's log lines on the terminal")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and every log line")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k6vsr", description="Kandinsky 6.0 video super-resolution, resumable.")
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("upscale", help="upscale one clip")
    _input_args(up)
    up.add_argument(
        "-o",
        "--output-dir",
        "--output-path",
        dest="output_dir",
        default=None,
        help="output folder, or an object-store prefix such as s3://bucket/out/ (default: beside the input)",
    )
    up.add_argument("--output-file-name", default=None, help="default: <stem>_sr<scale>x_<timestamp>.mp4")
    _param_flags(up)
    _model_flags(up)
    _run_flags(up)

    plan = commands.add_parser("plan", help="print what a run would do, without loading a model")
    _input_args(plan)
    _param_flags(plan)
    _model_flags(plan)
    plan.add_argument("--store", default=None)
    plan.add_argument("--json", action="store_true")
    plan.add_argument("--debug", action="store_true")

    preview = commands.add_parser(
        "preview", help="upscale a few representative windows first: a side-by-side MP4, a contact sheet, an estimate"
    )
    preview.add_argument("input", help="the video")
    preview.add_argument(
        "--windows", dest="preview_windows", type=int, default=3, help="windows to upscale (default 3)"
    )
    preview.add_argument("-o", "--output-dir", dest="output_dir", default=None, help="default: beside the input")
    _param_flags(preview, windows_flag=False)
    _model_flags(preview)
    preview.add_argument("--store", default=None, help="run store root (env K6VSR_STORE; default: per-user cache)")
    preview.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    preview.add_argument("--debug", action="store_true")

    demo = commands.add_parser("demo", help="run the whole pipeline on a synthetic clip with a tiny random model")
    demo.add_argument("-o", "--output-dir", dest="output_dir", default="k6vsr-demo")
    demo.add_argument("--scale", default="2")
    demo.add_argument("--json", action="store_true")
    demo.add_argument("--verbose", action="store_true")
    demo.add_argument("--debug", action="store_true")

    archive = commands.add_parser("archive", help="upscale every clip of a folder tree")
    archive.add_argument("input_dir")
    archive.add_argument("-o", "--output-dir", dest="output_dir", required=True)
    archive.add_argument("--include", action="append", default=None, help="glob of files to take (repeatable)")
    archive.add_argument("--exclude", action="append", default=None, help="glob of files to skip (repeatable)")
    archive.add_argument("--plan", action="store_true", help="write the plan and manifest, run nothing")
    archive.add_argument(
        "--max-parallel",
        type=int,
        default=ARCHIVE_CLIPS_IN_FLIGHT,
        help=f"clips in flight at once (default {ARCHIVE_CLIPS_IN_FLIGHT}: the next clip computes while the one "
        "before it is finished)",
    )
    archive.add_argument("--overwrite", action="store_true", help="replace finished outputs")
    _param_flags(archive)
    _model_flags(archive)
    _run_flags(archive)

    gc = commands.add_parser("gc", help="reclaim the disk of finished or abandoned runs")
    gc.add_argument("--store", default=None)
    gc.add_argument("--keep-outputs", action="store_true", help="keep each run's muxed output and manifest")
    gc.add_argument("--older-than-hours", type=float, default=0.0)
    gc.add_argument("--dry-run", action="store_true", help="say what would be reclaimed, delete nothing")
    gc.add_argument("--json", action="store_true")
    gc.add_argument("--debug", action="store_true")

    server = commands.add_parser(
        "server",
        help="the local Prefect server that keeps every run's history (started by any command that needs it)",
    )
    server.add_argument("action", choices=("start", "stop", "status"))
    server.add_argument("--json", action="store_true")
    server.add_argument("--debug", action="store_true")

    workers = commands.add_parser(
        "workers",
        help="warm Dask workers that keep models loaded across runs (used by every command while they run)",
    )
    workers.add_argument("action", choices=("start", "stop", "status"))
    workers.add_argument("-n", "--workers", type=int, default=0, help="CPU workers to start (default: one per GPU)")
    workers.add_argument("--gpus", action="store_true", help="one worker per GPU (the default when GPUs are found)")
    workers.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default=None,
        help="load this model at start (and, compiled on CUDA, warm every shape a default run compiles); the start "
        "returns once every worker has",
    )
    workers.add_argument("--revision", default=None)
    workers.add_argument("--model-id", default=None)
    workers.add_argument("--device", default="auto")
    workers.add_argument("--memory", default="auto", choices=MEMORY_MODES)
    workers.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --model: load it compiled on CUDA (default), as the commands that use the workers do, and warm it",
    )
    workers.add_argument("--json", action="store_true")
    workers.add_argument("--debug", action="store_true")

    cache = commands.add_parser(
        "cache",
        help="the compiled-kernel cache: export it to a file, import one (a fleet compiles once), or show it",
    )
    cache.add_argument("action", choices=("export", "import", "status"))
    cache.add_argument("file", nargs="?", default=None, help="the cache file (export, import)")
    cache.add_argument("--json", action="store_true")
    cache.add_argument("--debug", action="store_true")

    serve = commands.add_parser(
        "serve",
        help="SGLang-compatible HTTP job API (/v1/videos)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--allow-path", action="append", default=[], help="folder JSON video_path may point into")
    access = serve.add_argument_group("access")
    access.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="a client key (repeatable; env K6VSR_API_KEY); each job belongs to the key that made it",
    )
    access.add_argument("--api-key-file", action="append", default=None, help="file of client keys, one a line")
    access.add_argument("--admin-key", action="append", default=None, help="a key that sees and deletes every job")
    access.add_argument("--list-jobs", action="store_true", help="without keys: let GET /v1/videos list the jobs")
    access.add_argument("--umask", default="077", help="umask of the files and folders the server creates")
    limits = serve.add_argument_group("limits")
    limits.add_argument("--max-upload-mb", type=int, default=2048, help="size of one uploaded clip")
    limits.add_argument("--max-fields", type=int, default=32, help="fields of one request besides the clip")
    limits.add_argument(
        "--max-fields-kb", type=int, default=64, help="bytes of one request besides the clip: a JSON body, form fields"
    )
    limits.add_argument("--max-queued", type=int, default=16, help="jobs waiting for a worker, then 429")
    limits.add_argument(
        "--input-quota-mb",
        type=int,
        default=10240,
        help="inputs on disk of queued and running jobs: uploads, copies of video_path files",
    )
    limits.add_argument(
        "--max-output-mpx", type=float, default=2048, help="megapixels of one job's result: frames x width x height"
    )
    limits.add_argument("--max-tiles", type=int, default=2048, help="tile tasks of one job: tiles a window x windows")
    limits.add_argument("--max-windows", type=int, default=512, help="windows of frames of one job")
    limits.add_argument(
        "--upload-timeout-s", type=float, default=900, help="seconds a request body may take to arrive, then 408"
    )
    limits.add_argument(
        "--max-uploads-per-key",
        type=int,
        default=4,
        help="request bodies one key (without keys: one client address) may send at once, at most half of "
        "--max-queued (a larger value is lowered to it), then 429",
    )
    limits.add_argument(
        "--max-queued-per-key",
        type=int,
        default=8,
        help="queue places one key may hold, its waiting jobs and its requests being read together, then 429",
    )
    limits.add_argument(
        "--retention-hours",
        type=float,
        default=24,
        help="finished jobs, their files and runs are deleted this long after they finished",
    )
    limits.add_argument(
        "--finished-quota-mb",
        type=int,
        default=51200,
        help="disk that finished jobs (outputs and runs) may keep; past it the oldest finished are deleted first",
    )
    limits.add_argument(
        "--max-finished-per-key",
        type=int,
        default=1000,
        help="finished jobs (completed, failed, cancelled) one key keeps; past it its oldest finished are deleted",
    )
    limits.add_argument(
        "--memory-budget-mb",
        type=float,
        default=None,
        help="host memory the server and its job processes may use (default: 80%% of this machine's); a job whose "
        "estimate does not fit is refused at submit, one that outgrows it is stopped",
    )
    connections = serve.add_argument_group("connections")
    connections.add_argument(
        "--max-connections",
        type=int,
        default=1000,
        help="connections open at once (lowered to fit the open-file limit); past it the longest idle is closed",
    )
    connections.add_argument(
        "--header-timeout-s",
        type=float,
        default=10,
        help="seconds a connection may take to send a request's line and headers, then it is closed",
    )
    connections.add_argument(
        "--keep-alive-s", type=float, default=5, help="seconds an idle keep-alive connection stays open"
    )
    serve.add_argument("--workers", type=int, default=1, help="jobs run at once (each loads the model once)")
    serve.add_argument("--store", default=None, help="the run store: a folder or an object-store URL (s3://...)")
    serve.add_argument(
        "--jobs-dir",
        default=None,
        help="folder of the job records, inputs, outputs and the server's Prefect home (default: the --store "
        "folder; needed with an object store)",
    )
    _model_flags(serve)
    serve.add_argument("--verbose", action="store_true")
    serve.add_argument("--debug", action="store_true")
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


def _check_device(device: str) -> None:
    """A device this machine cannot use fails here, not after ingest inside a stage task."""
    import torch

    try:
        parsed = torch.device(device) if device != "auto" else None
    except (RuntimeError, ValueError):
        raise UserFacingError(f"--device {device!r} is not a device; use cpu, cuda, cuda:N or auto") from None
    if parsed is None or parsed.type == "cpu":
        return
    if parsed.type != "cuda":
        raise UserFacingError(f"--device {device!r} is not supported; use cpu, cuda, cuda:N or auto")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise UserFacingError(f"--device {device!r}: no CUDA GPU is available here; use cpu or auto")
    if parsed.index is not None and parsed.index >= count:
        raise UserFacingError(f"--device {device!r}: this machine has {count} CUDA GPU(s) (cuda:0 to cuda:{count - 1})")


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
    from entrypoints.progress import run_progress
    from service.runs import model_info, prepare_run
    from storage.urls import check_output_prefix, is_url, url_parent

    source, latent_fps = input_from(args)
    params = params_from(args)
    spec = model_from(args)
    store = store_from(args)
    # Plan first: a bad file, value or model fails here, before a server starts or a model loads, and before
    # Prefect is imported (seconds). The weights are checked against the architecture where the model loads.
    prepared = prepare_run(source, params, spec, store, latent_fps, tensors=False)
    status.say("loading Prefect")  # seconds, before the bar can show
    from flows.orchestrate import run_clip
    from runtime.runners import resolve_address

    # With warm workers (or a cluster given), they hold the model and the devices: this process only plans and
    # submits, and never imports torch (seconds). Otherwise its own threads compute, and it checks both now.
    address = resolve_address(args.workers, args.gpus, args.dask_address)
    if address is None:
        status.say("loading torch")
        model_info(spec)
        _check_device(spec.device)
    name = output_file_name(args.output_file_name or output_name(source, params, datetime.now()), params)
    # Beside the source by default: in its prefix for a source URL.
    given = args.output_dir or (url_parent(source_url) if source_url else None)
    if given and is_url(given):
        check_output_prefix(given)
        destination = f"{given.rstrip('/')}/{name}"
        if destination == source_url:
            raise UserFacingError(f"output {destination} is the input; pick another name or prefix")
    else:
        out_dir = Path(given).expanduser().resolve() if given else source.resolve().parent
        _check_output_dir(out_dir, _estimated_output_bytes(prepared.plan))
        _check_output_file(out_dir / name, source)
        destination = str(out_dir / name)
    with run_progress(prepared, enabled=not args.json):
        summary = run_clip(prepared, destination, spec, workers=args.workers, gpus=args.gpus, dask_address=address)
    return summary.model_dump(mode="json")


def output_file_name(name: str, params: UpscaleParams) -> str:
    """The name with the container's suffix added; a name with the other container's suffix is refused."""
    suffix = params.encoding.suffix
    other = ".mp4" if suffix == ".mkv" else ".mkv"
    if name.lower().endswith(other):
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
    _check_device(spec.device)
    from flows.orchestrate import prefect_api
    from flows.preview import preview_clip

    with prefect_api():
        summary = preview_clip(prepared=prepared, model=spec, count=args.preview_windows, out_dir=str(out_dir))
    return summary.model_dump(mode="json")


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
        "output_format": plan.output_format(),
        "window_mode": plan.params.windows,
        "cuts": list(plan.cuts),
        "windows": [
            {
                "window": w.index,
                "frames": [w.start, w.stop],
                "computed_as": w.padded,
                "overlap_before": plan.windows[w.index - 1].stop - w.start if w.index else 0,
                "segment": list(plan.segment_range(w.index)),
                "seeds": [c.seed for c in plan.chunks],
            }
            for w in plan.windows
        ],
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
        "model": prepared.model_info.identity,
        "model_weights_present": weights_present(Path(prepared.model_info.path)),
        "run_key": prepared.run.run_key,
        "finished_run_exists": prepared.finished,
    }


def _run_estimate(prepared: Any) -> dict[str, Any] | None:
    """The whole run's time and disk from the rates a preview of this run measured (`k6vsr preview`); None
    without one."""
    from storage.estimate import estimate_run, read_rates

    store = prepared.run.open()
    rates = read_rates(store)
    return None if rates is None else estimate_run(prepared.plan, rates).model_dump()


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
    }


def progress_of(prepared: Any) -> dict[str, int]:
    """The (window, tile) items a run of this plan has already finished, from the run store."""

    plan = prepared.plan
    store = prepared.run.open()
    return {
        "total": plan.num_windows * plan.num_tiles,
        "denoised": len(store.records.items("denoise")),
        "decoded": store.tiles_decoded(),
        "windows_blended": len(store.records.items("blend")),
        "segments": len(store.records.items("segment")),
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


def run_archive_command(args: argparse.Namespace, params: Any, spec: Any, store_root: str | Path) -> dict[str, Any]:
    """`k6vsr archive`: check the input, output and model first, then run the archive flow and return its summary."""
    status.say("loading Prefect")  # seconds, before the bars can show
    from entrypoints.progress import archive_progress
    from flows.orchestrate import prefect_api
    from flows.upscale_archive import (
        MANIFEST_NAME,
        ArchiveRow,
        ArchiveSummary,
        _summary,
        upscale_archive,
    )
    from service.runs import model_info

    source = Path(args.input_dir).expanduser().resolve()
    if not source.exists():
        raise UserFacingError(f"input {args.input_dir} does not exist")
    if args.max_parallel < 1:
        raise UserFacingError(f"--max-parallel must be at least 1, not {args.max_parallel}")
    output_dir = Path(args.output_dir).expanduser().resolve()
    if output_dir == source:
        raise UserFacingError(f"the output folder {args.output_dir} is the input folder; choose another one")
    _check_output_dir(output_dir)
    model_info(spec)  # a missing or broken model fails here, in one line, before any server starts
    # One API for every clip flow and worker: the configured one, else the local server (started if absent).
    with (
        archive_progress(output_dir / f"{MANIFEST_NAME}.json", args.max_parallel, enabled=not args.json),
        prefect_api(),
    ):
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
    manifest = output_dir.resolve() / f"{MANIFEST_NAME}.json"
    if isinstance(outcome, ArchiveFailed) and manifest.is_file():
        rows = [ArchiveRow.model_validate(r) for r in json.loads(manifest.read_text())["rows"]]
        base = Path(json.loads(manifest.read_text())["input"])
        return _summary(base, output_dir.resolve(), rows, args.plan, manifest, manifest.with_suffix(".csv")).model_dump(
            mode="json"
        )
    if isinstance(outcome, BaseException):
        raise outcome
    raise RuntimeError(f"the archive flow ended {state.name}: {state.message}")


def cmd_archive(args: argparse.Namespace) -> dict[str, Any]:
    result = run_archive_command(args, params_from(args), model_from(args), store_from(args))
    return {**result, "plan_only": bool(args.plan)}


def cmd_serve(args: argparse.Namespace) -> dict[str, Any]:
    from entrypoints.http_api import serve

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
    _check_device(spec.device)
    serve(args, spec, jobs_dir, run_root=store)
    return {}


def cmd_server(args: argparse.Namespace) -> dict[str, Any]:
    """`k6vsr server start|stop|status`: the local server, whatever `PREFECT_API_URL` says (status names it)."""
    from runtime import flow_leases, prefect_api, prefect_server

    if args.action == "start":
        flow_leases.mark_crashed_runs(prefect_server.start_server())
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
    print(f"  home: {result['home']}")
    if result.get("external_api_url"):
        print(f"  note: PREFECT_API_URL is set; commands report to {result['external_api_url']}")


def _print_human(command: str, result: dict[str, Any]) -> None:
    if command == "plan":
        print("\n".join(plan_lines(result)))
    elif command == "preview":
        print("\n".join(preview_lines(result)))
    elif command in ("upscale", "demo"):
        print("\n".join(summary_lines(result)))
    elif command == "server":
        _print_server(result)
    elif command == "workers":
        _print_workers(result)
    elif command == "cache":
        _print_cache(result)
    elif command == "gc":
        verb = "would reclaim" if result["dry_run"] else "reclaimed"
        runs = plural(sum(r["deleted"] for r in result["runs"]), "run")
        print(f"{verb} {size_text(result['bytes_reclaimed'])} from {runs}")
        for run in result["runs"]:
            what = f"{run['reason']}, {size_text(run['bytes'])}"
            print(f"  {'' if run['deleted'] else 'kept '}{run['run_key']}: {what}")
    elif command == "archive":
        for row in result.get("rows", []):  # every clip of a plan; of a run, those that failed, with the cause
            if result.get("plan_only") or row.get("status") == "failed":
                print(f"  {row.get('status', ''):>8}  {row.get('relative_path', '')}  {row.get('reason') or ''}")
        print(result.get("message") or "nothing to do")  # the counts, once
        print(f"manifest: {result.get('manifest_json')}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_terminal(verbose=args.debug or getattr(args, "verbose", False))
    handlers = {
        "upscale": cmd_upscale,
        "plan": cmd_plan,
        "preview": cmd_preview,
        "demo": cmd_demo,
        "gc": cmd_gc,
        "archive": cmd_archive,
        "serve": cmd_serve,
        "server": cmd_server,
        "workers": cmd_workers,
        "cache": cmd_cache,
    }
    try:
        with stopping.stop_on_interrupt():
            result = handlers[args.command](args)
    except (KeyboardInterrupt, interrupts.Interrupted) as err:  # outside a flow; inside one the flow stops first
        stopping.stop(interrupts.signal_of(err) or signal.SIGINT)
    except Exception as err:  # noqa: BLE001 - turned into one clear line below
        if args.debug:
            raise
        if isinstance(err, ServiceError):  # the server or the workers: not the user's doing, but said in one line
            print(f"k6vsr: error: {err}", file=sys.stderr)
            return EXIT_FAILED
        message = describe_error(err)
        if message is None:
            print(f"k6vsr: error: {type(err).__name__}: {err} (rerun with --debug for details)", file=sys.stderr)
            return EXIT_FAILED
        print(f"k6vsr: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "serve":
        return 0
    try:
        if getattr(args, "json", False):
            print(json.dumps(result, indent=2))
        else:
            _print_human(args.command, result)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (`k6vsr workers status | head -1`): no traceback. Python flushes stdout again at exit,
        # so it is pointed at /dev/null; the exit code is Python's advice for this case.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    return EXIT_FAILED if result.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
