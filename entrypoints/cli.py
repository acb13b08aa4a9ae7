"""The `k6vsr` command line: upscale, plan, demo, archive, gc, serve, server and workers.

Flag names follow SGLang's where they overlap, so its users recognise them. Errors a user can fix (a bad file, a bad
value, a missing model) are printed as one line naming the cause, with exit code 2 and no traceback (unless
`--debug`); nothing half-written is left in the output directory. A service that cannot start (the Prefect server,
the warm workers) is one line too, with exit code 1, as is an internal failure (with its type). Each command is a
module of `entrypoints.commands`, imported only when it runs, after its request flags are checked
(`entrypoints.request_inputs`): `--help` and a refused flag import none of the store, media or the model's code
(tests/command/test_command_start.py), and the commands that run flows import them (and Prefect, which takes seconds to
import) only once the run is planned, so `plan`, `gc` and `--help` answer at once.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from entrypoints import stopping
from entrypoints.console import configure_terminal, plan_lines, plural, preview_lines, size_text, summary_lines
from entrypoints.flags import input_flags, model_flags, output_flags, request_flags, run_flags, serve_flags, store_flag
from entrypoints.request_inputs import check_request
from k6vsr_core.errors import ServiceError, describe_error
from runtime import interrupts
from runtime.malloc_arenas import limit_malloc_arenas
from runtime.slots import ARCHIVE_CLIPS_IN_FLIGHT

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
        sub.set_defaults(handler=_handler(name, command.check), show=command.show)
    return parser


def _handler(name: str, check: Callable[[argparse.Namespace], None] | None) -> Callable[[argparse.Namespace], Any]:
    """Runs command `name`: `check` first (a refused value answers before anything heavy is imported), then
    `entrypoints.commands.<name>.run`, its module imported now."""

    def handle(args: argparse.Namespace) -> Any:
        if check is not None:
            check(args)
        return importlib.import_module(f"entrypoints.commands.{name}").run(args)

    return handle


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
    """A `k6vsr` command: its help, its flags and how its result is printed; `entrypoints.commands.<name>.run` runs
    it, after `check`."""

    help: str
    flags: Callable[[argparse.ArgumentParser], None]
    show: Callable[[dict[str, Any]], None] | None  # None: nothing to print (`serve` runs until stopped)
    parser_options: dict[str, Any] = field(default_factory=dict)
    check: Callable[[argparse.Namespace], None] | None = None


COMMANDS = {
    "upscale": Command("upscale one clip", _upscale_flags, _print_lines(summary_lines), check=check_request),
    "plan": Command(
        "print what a run would do, without loading a model",
        _plan_flags,
        _print_lines(plan_lines),
        check=check_request,
    ),
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
