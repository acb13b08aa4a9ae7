"""What the command line shows: warnings one line each, a short summary, the plan as a table, sizes people read.

The progress bar of a run is `entrypoints.progress_bars`.

The lines every task logs go to the Prefect UI and to the run's log file (`flows/run_log.py`), not to the terminal,
unless asked for with `--verbose`.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from k6vsr_core.status import STATUS_LOGGER

# Prefect's terminal handler, set through the environment so that every process a command starts (Dask workers, job
# processes) inherits it; the API handler, which feeds the UI, keeps every line. Its class keeps a flow or task
# run's own lines (and tracebacks) off the terminal unless asked for (`entrypoints.console_log`).
CONSOLE_LEVEL_ENV = "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"
CONSOLE_CLASS_ENV = "PREFECT_LOGGING_HANDLERS_CONSOLE_CLASS"
CONSOLE_CLASS = "entrypoints.console_log.CommandConsoleHandler"
# Prefect's client telemetry switch (it reads no setting of its own): off, so that a new user's first command shows
# its output, not Prefect's notice about usage data. Our server's analytics are off too (runtime.prefect_server).
TELEMETRY_ENV = "DO_NOT_TRACK"
# k6vsr's packages (pyproject's), side by side in the folder that holds them: the repository or site-packages.
OWN_PACKAGES = ("k6vsr_core", "storage", "service", "tasks", "runtime", "flows", "entrypoints")
PACKAGES_ROOT = Path(__file__).resolve().parents[1]
# Where a library's warnings go instead of the terminal (as its SyntaxWarning or DeprecationWarning while imported).
LIBRARY_WARNINGS = logging.getLogger("k6vsr.library_warnings")


class StatusLines(logging.Handler):
    """What the command is doing (`k6vsr_core.status`), one line each on the terminal, above the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm  # writes above a bar that is showing, and redraws it below

        try:
            tqdm.write(f"k6vsr: {record.getMessage()}", file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging's rule: a handler never raises
            self.handleError(record)


def configure_terminal(verbose: bool) -> None:
    """Warnings (one line each) and errors on the terminal; what the command is doing while no bar shows it (on a
    terminal); every log line too when `verbose`."""
    status_log = logging.getLogger(STATUS_LOGGER)
    if (verbose or sys.stderr.isatty()) and not any(isinstance(h, StatusLines) for h in status_log.handlers):
        status_log.addHandler(StatusLines())
        status_log.setLevel(logging.INFO)
        status_log.propagate = False  # said once: not again by Prefect's console handler
    level = "INFO" if verbose else "WARNING"
    os.environ[CONSOLE_LEVEL_ENV] = level
    os.environ.setdefault(TELEMETRY_ENV, "1")
    os.environ[CONSOLE_CLASS_ENV] = CONSOLE_CLASS
    if "prefect.logging.handlers" in sys.modules:  # Prefect already set up its logging here: tell its handlers too
        from prefect.logging.handlers import PrefectConsoleHandler

        loggers = [logging.getLogger(), *(logging.getLogger(name) for name in logging.root.manager.loggerDict)]
        for handler in {h for logger in loggers for h in logger.handlers if isinstance(h, PrefectConsoleHandler)}:
            handler.setLevel(level)
    if verbose:
        return
    # A logging handler that fails (Prefect's, sending run logs to a server that went away) would write its own error
    # onto the terminal, half a line each, into the middle of the command's lines: the stdlib's production setting.
    logging.raiseExceptions = False
    warnings.showwarning = _show_once
    # Notes for developers, not users: torch's about its kernels, diffusers' about the configs' native key names.
    warnings.filterwarnings("ignore", message=".*flex attention.*")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    os.environ["DIFFUSERS_VERBOSITY"] = "error"  # diffusers sets its level when imported, after this


_SHOWN: set[str] = set()


def _show_once(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    """One line per warning of k6vsr's own, each said once: planning before the run and ingest in it may see the
    same thing. Another package's warning is for its developers, not k6vsr's users: a debug log line."""
    if not own_warning(category, filename):
        LIBRARY_WARNINGS.debug("%s:%s: %s: %s", filename, lineno, category.__name__, message)
        return
    text = f"k6vsr: warning: {message}"
    if text not in _SHOWN:
        _SHOWN.add(text)
        from tqdm import tqdm  # on a line of its own above a bar that is showing, the bar redrawn below

        tqdm.write(text, file=sys.stderr)


def own_warning(category: type[Warning], filename: str) -> bool:
    """Whether a warning is k6vsr's: of a category of its own, or raised (as its `stacklevel` says) in its code."""
    if category.__module__.partition(".")[0] in OWN_PACKAGES:
        return True
    try:
        where = Path(filename).resolve().relative_to(PACKAGES_ROOT)
    except ValueError:
        return False
    return len(where.parts) > 1 and where.parts[0] in OWN_PACKAGES


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """Six lines: the output, the tiles, the time by stage, the items computed and reused by stage, the run's folder
    and its log."""
    from storage.progress import StageCount  # the store's code: not imported for `--help`

    width, height = summary["size"]
    frames = summary["frames"]
    timings = summary["timings"]
    spans = summary.get("spans", {})
    output = summary.get("output_format", {})
    rate = output.get("frame_rate", summary["fps"])  # exact: 30000/1001 stays so
    pace = f"{rate} fps on average, each frame at its source's time" if output.get("variable_rate") else f"{rate} fps"
    return [
        f"wrote {summary['output']} ({width}x{height}, {frames} frame{'s' * (frames != 1)} at {pace})",
        f"run {summary['run_key']}: {summary['tiles_computed']} of {summary['tiles_total']} tiles computed, "
        f"{summary['tiles_reused']} reused, {summary['dit_calls']} DiT calls"
        + ("; the output was already in the store" if summary["reused_output"] else ""),
        "seconds by stage, wall clock (busy): "
        + ", ".join(f"{stage} {spans.get(stage, 0.0):.1f} ({busy:.1f})" for stage, busy in timings.items()),
        "items by stage: "
        + "; ".join(
            f"{stage}: {StageCount.model_validate(count).text()}" for stage, count in summary.get("items", {}).items()
        ),
        f"store: {summary['store']}",
        f"log: {summary['log']}",
    ]


def size_text(size: int) -> str:
    """Bytes as people read them: 512 B, 40.0 MB, 1.20 GB (decimal units, as disks are sold)."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}" if unit == "GB" else f"{size / scale:.1f} {unit}"
    return f"{size} B"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"


def _span(first: int, stop: int) -> str:
    """A half-open range of frames as people count them: 0-120."""
    return f"{first}-{stop - 1}" if stop - first > 1 else str(first)


def _seeds(seeds: list[int]) -> str:
    consecutive = seeds == list(range(seeds[0], seeds[0] + len(seeds)))
    return f"{seeds[0]}-{seeds[-1]}" if consecutive and len(seeds) > 1 else ", ".join(map(str, seeds))


def _weights_note(plan: dict[str, Any]) -> str:
    """A plan reads the model's configs only; a local bundle without its weights has an identity of its own."""
    if plan.get("model_weights_present", True):
        return ""
    if plan["model"].startswith("local:"):
        return " (configs only: the run key changes once the weight files are in the folder)"
    return " (configs only)"


CUTS_SHOWN = 12  # a long film has hundreds: `plan --json` lists them all


def _cuts(plan: dict[str, Any]) -> str:
    """How the windows were laid: nothing for even windows; the cuts (kept frames that start a shot) for scenes."""
    if plan.get("window_mode") != "scenes":
        return ""
    cuts = plan["cuts"]
    if not cuts:
        return ", within shots: no scene cut found"
    shown = ", ".join(str(cut) for cut in cuts[:CUTS_SHOWN]) + (
        f" and {len(cuts) - CUTS_SHOWN} more" if len(cuts) > CUTS_SHOWN else ""
    )
    return f", within shots: {plural(len(cuts), 'scene cut')}, before frame{'s' if len(cuts) > 1 else ''} {shown}"


def _shots(plan: dict[str, Any]) -> list[str]:
    """With scene windows, the shots and what happens to those shorter than a window (`plan --json` has each)."""
    if plan.get("window_mode") != "scenes" or "shots" not in plan:
        return []
    shots = plan["shots"]
    short = [shot for shot in shots if shot["short"]]
    line = f"shots     {len(shots)}, hard cuts between them (never a cross-fade)"
    if not short:
        return [line]
    shown = ", ".join(
        f"{_span(*shot['frames'])} ({plural(shot['frames'][1] - shot['frames'][0], 'frame')}, as {shot['computed_as']})"
        for shot in short[:CUTS_SHOWN]
    ) + (f" and {len(short) - CUTS_SHOWN} more" if len(short) > CUTS_SHOWN else "")
    return [
        line + f"; {len(short)} shorter than a window, each one window of its own padded as a short clip is "
        f"(computed as 1 + 8k frames, cropped back): {shown}"
    ]


def _cost(estimate: dict[str, Any] | None) -> str:
    """The whole run's time and disk as a preview measured them on this machine, or how to get them."""
    if estimate is None:
        return "no estimate yet: `k6vsr preview` upscales a few windows and measures this machine's rates"
    return (
        f"about {estimate['seconds']:.0f} s on this machine ({estimate['seconds_left']:.0f} s left), "
        f"{size_text(estimate['output_bytes'])} of output, at most {size_text(estimate['peak_store_bytes'])} of "
        f"store, from {plural(estimate['windows_measured'], 'window')} previewed"
    )


def preview_lines(preview: dict[str, Any]) -> list[str]:
    """`k6vsr preview` for people: what was upscaled, where to look, and what the whole run will cost."""
    spans = ", ".join(f"{start}-{stop - 1}" for start, stop in preview["frames"])
    return [
        f"previewed {plural(len(preview['windows']), 'window')} (frames {spans}), kept in run {preview['run_key']}",
        f"side by side  {preview['side_by_side']}",
        f"contact sheet {preview['contact_sheet']}",
        f"whole run     {_cost(preview['estimate'])}",
    ]


def _aspect_lines(aspect: dict[str, Any] | None) -> list[str]:
    """A line for non-square pixels only: square ones are the rule and were never shown."""
    if not aspect or aspect["sample_aspect"] == aspect["source_sample_aspect"] == "1":
        return []
    return [
        f"aspect    {aspect['display_aspect']} on screen from pixels of {aspect['sample_aspect']} "
        f"({aspect['pixels']}; source {aspect['source_display_aspect']}, pixels {aspect['source_sample_aspect']})"
    ]


def _fields(found: dict[str, Any] | None) -> list[str]:
    """The source's fields and what the request does with them; nothing for a latent, which has none."""
    if found is None:
        return []
    done = f"deinterlaced ({found['filter']})" if found["filter"] else "read as they are"
    return [f"fields    {found['summary']}; {done}, deinterlace {found['deinterlace']}"]


def _timing(found: dict[str, Any] | None) -> list[str]:
    """The source's frame times: constant, or variable and resampled on them; nothing for a latent."""
    if found is None or not found["variable"]:
        return [] if found is None else ["timing    constant frame rate"]
    spread = f"{found['slowest_fps']:.3g} to {found['fastest_fps']:.3g} fps, {found['mean_fps']:.3g} on average"
    if found.get("times_kept"):
        return [f"timing    variable frame rate ({spread}): every frame kept at its own time (--fps source)"]
    return [f"timing    variable frame rate ({spread}): frames chosen on their timestamps at {found['output_fps']} fps"]


def _pixel_lines(output: dict[str, Any]) -> list[str]:
    """The 16-bit path and the HDR metadata written, where they apply (an 8-bit run says nothing more)."""
    if output.get("pixel_depth", 8) == 8:
        return []
    hdr = output.get("hdr_metadata")
    kept = f"; HDR metadata written: {hdr}" if hdr else ""
    return [f"pixels    16 bits a sample from the source's decode to the encoder, never 8{kept}"]


def plan_lines(plan: dict[str, Any]) -> list[str]:
    """`k6vsr plan` for people: what goes in and out, the tiles, the windows as a table, the disk and the progress."""
    size = plan["source_size"]
    rate = f"{plan['latent_fps']} fps (a latent)" if plan.get("latent_fps") else f"{plan['source_fps']:g} fps"
    output = plan["output_format"]
    out = plan["output_size"]
    quality = f"CRF {output['crf']}" if output.get("crf") is not None else "lossless"
    if output.get("profile"):
        quality = f"profile {output['profile']}"
    preset = f", preset {output['preset']}" if output.get("preset") else ""
    tile = plan["tile"]
    grid = f"{len(tile['tops'])}x{len(tile['lefts'])}"
    base = f"{tile['base'][1]}x{tile['base'][0]}"
    padding = plan["padding"]
    seeds = [chunk["seed"] for chunk in plan["chunks"]]
    estimate = plan["store_estimate"]
    items = plan["items"]
    source_frames, kept = plural(plan["source_frames"], "frame"), plural(plan["frames_kept"], "frame")
    source_colour = f", colour {plan['source_colour']}" if plan.get("source_colour") else ""
    colour = f", colour {output['colour']}" if output.get("colour") else ""
    lines = [
        f"source    {plan['source']}: {size['width']}x{size['height']}, {source_frames} at {rate}{source_colour}",
        *_fields(plan.get("interlacing")),
        *_timing(plan.get("timing")),
        f"output    {out['width']}x{out['height']}, {kept} at {output['frame_rate']} fps"
        f"{' on average' if output.get('variable_rate') else ''}, "
        f"{output['codec']} {output['pix_fmt']} {quality}{preset} in {output['container']}{colour}, "
        f"audio {output['audio']}",
        *_aspect_lines(plan.get("aspect")),
        *_pixel_lines(output),
        f"model     {plan['model']}{_weights_note(plan)}",
        f"tiles     {plan['tiles_per_window']} a window ({grid} tiles of {base} px after SR, padding "
        f"{padding['bottom']} px bottom and {padding['right']} px right), {len(plan['chunks'])} batches, seeds "
        f"{_seeds(seeds)}, {plan['dit_steps_per_tile']} DiT steps a tile",
        f"windows   {len(plan['windows'])}{_cuts(plan)}",
        "            window  frames        computed as  overlap  segment",
    ]
    for window in plan["windows"]:
        lines.append(
            f"            {window['window']:<6}  {_span(*window['frames']):<12}  {window['computed_as']:<11}  "
            f"{window['overlap_before']:<7}  {_span(*window['segment'])}"
        )
    lines += _shots(plan)
    peak, window_bytes = size_text(estimate["peak_bytes"]), size_text(estimate["window_bytes"])
    lines += [
        f"store     at most about {peak} while it runs ({window_bytes} a window in flight), "
        f"{size_text(estimate['encoded_bytes'])} of video",
        f"cost      {_cost(plan.get('run_estimate'))}",
        f"run       {plan['run_key']}: "
        + (
            "finished, the output is in the store"
            if plan["finished_run_exists"]
            else f"{items['decoded']} of {items['total']} (window, tile) items done, {items['segments']} of "
            f"{plural(len(plan['windows']), 'segment')}"
        ),
    ]
    return lines
