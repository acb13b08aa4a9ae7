"""The command's flags, each declared once.

The request group is the request model itself (`UpscaleParams`): a flag per field, `--field-name` unless spelled
otherwise below, its type from the field's, its help from the field's description and default. SGLang's names stand
beside ours where they overlap, so its users recognise them. A request flag not given is left out, so the request
takes the model's (official) default.
"""

from __future__ import annotations

import argparse
from typing import Any

from k6vsr_core import settings
from k6vsr_core.contract.params import UpscaleParams
from k6vsr_core.contract.release_config import DEFAULT_MODEL
from k6vsr_core.device.memory_modes import MEMORY_MODES

# Request fields whose flags are not `--field-name`, and SGLang's aliases (`--sr-...`, `--model-path`).
REQUEST_FLAGS: dict[str, tuple[str, ...]] = {
    "scale": ("--scale", "--sr-resolution-scale"),
    "tiles_batch_size": ("--tiles-batch-size", "--sr-tiles-batch-size"),
    "min_overlap": ("--tile-min-overlap", "--sr-tile-min-overlap"),
    "target_resolution": ("--target-resolution", "--sr-target-resolution"),
    "target_resize_mode": ("--target-resize-mode", "--sr-target-resize-mode"),
    "fps_mode": ("--fps",),
    "windows": ("--windows", "--window-mode"),
}
# What a flag means on the command line beyond the field: `--fps` also takes a latent's rate.
COMMAND_LINE_NOTES = {
    "fps_mode": "; with --latent: the latent's frame rate, e.g. 24 or 30000/1001 (required)",
}
TEXT_FIELDS = {"scale"}  # parsed by the model, whose message names the allowed values


def _flag_type(name: str, annotation: Any) -> type | None:
    if name in TEXT_FIELDS:
        return None
    for kind in (int, float):
        if annotation is kind or annotation == kind | None:
            return kind
    return None


def _help(name: str, defaults: UpscaleParams) -> str:
    field = UpscaleParams.model_fields[name]
    default = getattr(defaults, name)
    text = field.description or ""
    if default is not None and "(default" not in text:
        shown = defaults.scale_label if name == "scale" else default
        text += f" (default {shown})"
    return text + COMMAND_LINE_NOTES.get(name, "")


def request_flags(parser: argparse.ArgumentParser, windows_flag: bool = True) -> None:
    """The request group. `k6vsr preview` takes `--windows N` for its window count: there the mode is
    `--window-mode` only."""
    defaults = UpscaleParams()
    group = parser.add_argument_group("request", argument_default=argparse.SUPPRESS)
    for name, field in UpscaleParams.model_fields.items():
        names = REQUEST_FLAGS.get(name, (f"--{name.replace('_', '-')}",))
        if name == "windows" and not windows_flag:
            names = ("--window-mode",)
        options: dict[str, Any] = {"dest": name, "help": _help(name, defaults)}
        kind = _flag_type(name, field.annotation)
        if kind is not None:
            options["type"] = kind
        if name == "fps_mode":
            options["metavar"] = "MODE_OR_RATE"
        group.add_argument(*names, **options)


def model_flags(parser: argparse.ArgumentParser, at_start: bool = False) -> None:
    """The model and how it runs. `at_start`: `k6vsr workers start`, which loads one only when it is named."""
    group = parser.add_argument_group("model")
    model_help = (
        "load this model at start (and, compiled on CUDA, warm every shape a default run compiles); the start "
        "returns once every worker has"
        if at_start
        else "Hugging Face repo id or local folder in the Diffusers layout (env K6VSR_MODEL); without a GPU or the "
        "hub: k6vsr-demo/tiny-bundle, the tiny random model `k6vsr demo` writes"
    )
    default_model = None if at_start else (settings.read(settings.Compute).model or DEFAULT_MODEL)
    group.add_argument("--model", "--model-path", dest="model", default=default_model, help=model_help)
    group.add_argument("--revision", default=None, help="hub revision (default: the pinned release revision)")
    group.add_argument(
        "--model-id",
        default=None,
        help="identity of a local copy (e.g. the repo id it came from), so its runs are shared",
    )
    group.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    budgets = " or ".join(", ".join(MEMORY_MODES[1:]).rsplit(", ", 1))
    group.add_argument(
        "--memory",
        default="auto",
        choices=MEMORY_MODES,
        help=f"GPU memory budget: auto (default: the fastest that fits the clip on the GPU's memory), {budgets}",
    )
    group.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CUDA, compile the DiT blocks and the KVAE decoder (default); --no-compile runs them eagerly "
        "(NABLA's flex attention is compiled either way). Kernels are cached per machine: see `k6vsr cache`",
    )


def input_flags(parser: argparse.ArgumentParser) -> None:
    """A video, or a latent: exactly one of them (`entrypoints.request_inputs.input_from`)."""
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


def store_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default=None, help="run store root (env K6VSR_STORE; default: per-user cache)")


def output_flags(parser: argparse.ArgumentParser, json_summary: bool = True, verbose: bool = False) -> None:
    """What the command prints: a JSON summary instead of lines, every task's log lines, tracebacks."""
    if json_summary:
        parser.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    if verbose:
        parser.add_argument("--verbose", action="store_true", help="show every task's log lines on the terminal")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and every log line")


def run_flags(parser: argparse.ArgumentParser) -> None:
    """Where a run's tiles compute and its stages are stored."""
    store_flag(parser)
    parser.add_argument("--workers", type=int, default=1, help="worker processes for tiles (default 1: in-process)")
    parser.add_argument("--gpus", action="store_true", help="one Dask worker per GPU")
    parser.add_argument("--dask-address", default=None, help="run tiles on an existing Dask scheduler")
    output_flags(parser, verbose=True)


# `k6vsr serve`'s limits and connection bounds: flag, type, default, help.
SERVE_LIMITS: tuple[tuple[str, type, float | None, str], ...] = (
    ("--max-upload-mb", int, 2048, "size of one uploaded clip"),
    ("--max-fields", int, 32, "fields of one request besides the clip"),
    ("--max-fields-kb", int, 64, "bytes of one request besides the clip: a JSON body, form fields"),
    ("--max-queued", int, 16, "jobs waiting for a worker, then 429"),
    ("--input-quota-mb", int, 10240, "inputs on disk of queued and running jobs: uploads, copies of video_path files"),
    ("--max-output-mpx", float, 2048, "megapixels of one job's result: frames x width x height"),
    ("--max-tiles", int, 2048, "tile tasks of one job: tiles a window x windows"),
    ("--max-windows", int, 512, "windows of frames of one job"),
    ("--upload-timeout-s", float, 900, "seconds a request body may take to arrive, then 408"),
    (
        "--min-upload-kb-s",
        float,
        8,
        "KiB a second a request body must average over each --upload-rate-window-s while it arrives, else 408 and "
        "its upload slot is given back (0: no floor)",
    ),
    ("--upload-rate-window-s", float, 30, "seconds over which --min-upload-kb-s is measured"),
    (
        "--max-uploads-per-key",
        int,
        4,
        "request bodies one key (without keys: one client address) may send at once, at most half of --max-queued "
        "(a larger value is lowered to it) and less while other keys send (their share of it), then 429",
    ),
    (
        "--max-queued-per-key",
        int,
        None,
        "queue places one key may hold, its waiting jobs and its requests being read together, whatever its share "
        "(default: none; a key's share is --max-queued divided by the keys waiting, all of it when alone), then 429",
    ),
    ("--retention-hours", float, 24, "finished jobs, their files and runs are deleted this long after they finished"),
    (
        "--finished-quota-mb",
        int,
        51200,
        "disk that finished jobs (outputs and runs) may keep; past it the oldest finished are deleted first",
    ),
    (
        "--max-finished-per-key",
        int,
        1000,
        "finished jobs (completed, failed, cancelled) one key keeps; past it its oldest finished are deleted",
    ),
    (
        "--memory-budget-mb",
        float,
        None,
        "host memory the server and its job processes may use (default: 80%% of this machine's); a job whose "
        "estimate does not fit is refused at submit, one that outgrows it is stopped",
    ),
)
SERVE_CONNECTIONS: tuple[tuple[str, type, float | None, str], ...] = (
    (
        "--max-connections",
        int,
        1000,
        "connections open at once (lowered to fit the open-file limit); past it the one waiting longest (for a "
        "request, or for its client to read) is closed",
    ),
    (
        "--header-timeout-s",
        float,
        10,
        "seconds a connection may take to send a request's line and headers, then it is closed",
    ),
    ("--keep-alive-s", float, 5, "seconds an idle keep-alive connection stays open"),
    (
        "--send-timeout-s",
        float,
        30,
        "seconds a client may leave an answer's bytes unread (each time they wait for it), then it is dropped",
    ),
    (
        "--send-buffer-kb",
        int,
        None,
        "the kernel's send buffer of each connection (default: the kernel's own, which grows to a few MB): what a "
        "client that never reads makes the server send before its connection stops progressing",
    ),
)


def _access_flags(parser: argparse.ArgumentParser) -> None:
    access = parser.add_argument_group("access")
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


def serve_flags(parser: argparse.ArgumentParser) -> None:
    """`k6vsr serve`: where it listens, who may use it, its bounds, its jobs and their model."""
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface: set --api-key then)"
    )
    parser.add_argument("--port", type=int, default=30000, help="TCP port to listen on (SGLang's default)")
    parser.add_argument("--allow-path", action="append", default=[], help="folder JSON video_path may point into")
    _access_flags(parser)
    for title, table in (("limits", SERVE_LIMITS), ("connections", SERVE_CONNECTIONS)):
        group = parser.add_argument_group(title)
        for flag, kind, default, text in table:
            group.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument("--workers", type=int, default=1, help="jobs run at once (each loads the model once)")
    parser.add_argument("--store", default=None, help="the run store: a folder or an object-store URL (s3://...)")
    parser.add_argument(
        "--jobs-dir",
        default=None,
        help="folder of the job records, inputs, outputs and the server's Prefect home (default: the --store "
        "folder; needed with an object store)",
    )
    model_flags(parser)
    output_flags(parser, json_summary=False, verbose=True)
