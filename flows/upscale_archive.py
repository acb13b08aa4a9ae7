"""The archive flow: upscale every clip of a folder tree (or a list of paths), one clip flow run per clip.

1. Scan: the files of `input_dir` matching the include globs (common video extensions) and none of the exclude
   globs, recursively, in sorted order; hidden files and folders and the output folder are left out.
2. Plan every clip without loading a model (`prepare_run`): its run key, frames and tiles. A file that cannot be
   probed is `skipped` with the reason. Each output mirrors the input tree under `output_dir`, named
   `<stem>_sr<scale>x.mp4`: the clip flow's rule without the timestamp, so a rerun finds what an earlier run made.
   An existing output is `reused`, never overwritten unless `overwrite`.
3. Run the pending clips, `max_parallel` at once (2 by default), each as its own `upscale-clip` flow run (a subflow
   of the archive run); a clip that fails is recorded as `failed` with the reason and the others go on. The clips
   share one model queue, in which an earlier clip's ready work goes first: the next clip's work fills the model
   slots the earlier one leaves free (its first encode while the earlier one decodes, its tiles while the earlier
   one blends, encodes its segments and muxes).

The manifest (`k6vsr-archive-manifest.json` and `.csv` in `output_dir`, one row per clip) is rewritten atomically
after planning and after every clip. In the Prefect UI the archive run shows a progress artifact over clips and one
manifest table, updated in place, whose rows link to the clip runs; each clip run shows its own artifacts. A rerun
does only what is missing; the archive run ends Failed when a clip failed, after the manifest and artifacts are
written.
"""

from __future__ import annotations

import contextlib
import contextvars
import csv
import fnmatch
import hashlib
import io
import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, cast, get_args
from uuid import UUID

from prefect import Flow, flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Failed, State
from pydantic import BaseModel

from flows import artifacts
from flows.upscale_clip import ClipSummary, upscale_clip
from k6vsr_core.errors import UserFacingError, describe_error
from k6vsr_core.params import UpscaleParams, output_name
from runtime.flow_leases import leased
from runtime.lanes import ARCHIVE_QUEUE, SharedQueue
from runtime.runners import make_task_runner, own_processes, resolve_address, start_cluster, uses_processes
from runtime.slots import ARCHIVE_CLIPS_IN_FLIGHT
from runtime.warm_workers import split_cluster
from service.runs import ModelSpec, PreparedRun, model_info, prepare_run
from storage import default_store_root, parse_store_root, run_key, source_info
from storage.records import atomic_write_bytes
from tasks.worker_preload import preload_in_background

VIDEO_GLOBS = (
    "*.mp4",
    "*.m4v",
    "*.mov",
    "*.mkv",
    "*.webm",
    "*.avi",
    "*.wmv",
    "*.flv",
    "*.mpg",
    "*.mpeg",
    "*.m2v",
    "*.ts",
    "*.mts",
    "*.m2ts",
    "*.mxf",
    "*.3gp",
    "*.ogv",
    "*.y4m",
)
MANIFEST_NAME = "k6vsr-archive-manifest"
# The manifest artifact is rewritten whole on each update: at most once per this many seconds, and at the end.
TABLE_EVERY_S = 10.0
PLAN_THREADS = 8
REASON_LIMIT = 2000

Status = Literal["done", "reused", "failed", "skipped", "planned"]
STATUSES: tuple[Status, ...] = get_args(Status)


class ArchiveRow(BaseModel):
    """One clip of the archive: what was (or will be) done with it."""

    source: str
    relative_path: str
    status: Status
    reason: str = ""
    run_key: str = ""
    frames: int | None = None
    tiles: int | None = None
    tiles_computed: int | None = None
    tiles_reused: int | None = None
    seconds: float | None = None
    output: str = ""


class ArchiveSummary(BaseModel):
    input: str
    output_dir: str
    counts: dict[str, int]
    message: str
    manifest_json: str
    manifest_csv: str
    failed: bool
    rows: list[ArchiveRow]


# ------------------------------------------------------------------------------------------------ naming


def archive_slug(input_dir: str | Path | None, paths: list[str] | None = None) -> str:
    """Artifact keys of one archive: its folder name and a short hash of its absolute path (or of the path list)."""
    if input_dir is not None:
        location = str(Path(input_dir).expanduser().resolve())
        name = Path(location).name
    else:
        location = "\n".join(sorted(str(Path(p).expanduser().resolve()) for p in paths or []))
        name = "list"
    readable = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40] or "archive"
    return f"{readable}-{hashlib.sha1(location.encode()).hexdigest()[:6]}"


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    parameters = flow_run.parameters
    if parameters.get("input_dir"):
        return f"archive-{Path(str(parameters['input_dir'])).name}"
    return f"archive-{len(parameters.get('paths') or [])}-paths"


# ------------------------------------------------------------------------------------------------ scan


def _matches(relative: str, globs: list[str] | tuple[str, ...]) -> bool:
    """Case-insensitive match of a glob against the relative path or the file name."""
    name = relative.rsplit("/", 1)[-1].lower()
    lowered = relative.lower()
    return any(fnmatch.fnmatchcase(lowered, g.lower()) or fnmatch.fnmatchcase(name, g.lower()) for g in globs)


def scan_folder(
    input_dir: Path, include: list[str] | tuple[str, ...], exclude: list[str] | tuple[str, ...], skip: Path | None
) -> list[Path]:
    """Files under `input_dir` matching `include` and not `exclude`, sorted; hidden entries and `skip` left out."""
    found = []
    for folder, dirs, files in os.walk(input_dir):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and (skip is None or here / d != skip))
        for name in sorted(files):
            if name.startswith("."):
                continue
            relative = (here / name).relative_to(input_dir).as_posix()
            if _matches(relative, include) and not _matches(relative, exclude):
                found.append(here / name)
    return found


def read_path_list(list_file: Path) -> list[str]:
    """One path per line; blank lines and `#` comments ignored; relative paths are relative to the list file."""
    paths = []
    for line in list_file.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            path = Path(line).expanduser()
            paths.append(str(path if path.is_absolute() else list_file.parent / path))
    return paths


def _sources(
    input_dir: str | None, paths: list[str] | None, output_dir: Path, include: list[str], exclude: list[str]
) -> tuple[Path, list[Path]]:
    """The base folder the output tree mirrors, and the sources in order."""
    if paths:
        sources = [Path(p).expanduser().resolve() for p in paths]
        if input_dir:
            base = Path(input_dir).expanduser().resolve()
        else:
            base = Path(os.path.commonpath([str(s.parent) for s in sources]))
        return base, sources
    if not input_dir:
        raise UserFacingError("give input_dir (a folder or a file listing paths) or paths")
    base = Path(input_dir).expanduser().resolve()
    if base.is_file():
        return _sources(None, read_path_list(base), output_dir, include, exclude)
    if not base.is_dir():
        raise UserFacingError(f"input folder {input_dir} does not exist")
    if output_dir == base:
        raise UserFacingError(
            f"the output folder {output_dir} is the input folder: outputs would be read as inputs "
            "by the next run; choose another folder (a subfolder of the input is fine)"
        )
    return base, scan_folder(base, include, exclude, skip=output_dir)


# ------------------------------------------------------------------------------------------------ plan


class SourceStamp(BaseModel):
    """What the manifest remembers of a planned source: enough to know, without reading it, that it is unchanged."""

    size: int
    mtime_ns: int
    sha256: str


class _Previous(BaseModel):
    """What an earlier archive run into the same output folder made or found: by relative path, the run key of each
    output and the stamp of its source when it was planned."""

    rows: dict[str, ArchiveRow] = {}
    sources: dict[str, SourceStamp] = {}


def _previous(manifest_json: Path) -> _Previous:
    try:
        payload = json.loads(manifest_json.read_text())
        rows = {
            r["relative_path"]: ArchiveRow.model_validate(r)
            for r in payload["rows"]
            if r["status"] in ("done", "reused") and r["run_key"]
        }
        return _Previous(rows=rows, sources=payload.get("sources") or {})
    except (OSError, ValueError, KeyError, TypeError):
        return _Previous()


def _stamp(source: Path) -> SourceStamp:
    """The source's size and time before its hash: a file changed meanwhile is stamped older, so it is planned again
    next time, never taken for unchanged."""
    stat = source.stat()
    return SourceStamp(size=stat.st_size, mtime_ns=stat.st_mtime_ns, sha256=source_info(source).sha256)


def _unchanged(
    source: Path, relative: str, output: Path, key_of: Callable[[str], str], previous: _Previous
) -> ArchiveRow | None:
    """The reused row of a source whose output exists and whose earlier row still holds: the same file (size and
    time as stamped) and the same request (the run key of its recorded hash now is the one that made the output). No
    probe, no hash: a rerun of a finished archive costs a stat a clip. None when anything differs: planned in full."""
    earlier, stamp = previous.rows.get(relative), previous.sources.get(relative)
    if earlier is None or stamp is None or earlier.output != str(output) or not output.is_file():
        return None
    try:
        stat = source.stat()
    except OSError:
        return None
    if (stat.st_size, stat.st_mtime_ns) != (stamp.size, stamp.mtime_ns) or key_of(stamp.sha256) != earlier.run_key:
        return None
    return earlier.model_copy(
        update={
            "source": str(source),
            "status": "reused",
            "reason": "output exists",
            "tiles_computed": 0,
            "tiles_reused": earlier.tiles,
            "seconds": None,
        }
    )


def _describe(err: BaseException) -> str:
    """A row's reason: the user's one line, or the internal error's type and message."""
    return (describe_error(err) or f"{type(err).__name__}: {err}")[:REASON_LIMIT]


def plan_clips(
    base: Path,
    sources: list[Path],
    output_dir: Path,
    params: UpscaleParams,
    model: ModelSpec,
    store_root: str,
    overwrite: bool,
    stamps: dict[str, SourceStamp] | None = None,
) -> tuple[list[ArchiveRow], dict[str, PreparedRun]]:
    """One row per source: `planned`, `reused` (output exists) or `skipped` (with the reason); and the plan of each
    clip to run, by relative path, which its clip flow then runs. Loads no model. `stamps` receives the stamp of
    every source planned or found unchanged, for the manifest (the next run's quick check, `_unchanged`)."""
    # Once, first, in this thread: a broken model fails the archive rather than every clip, and diffusers' lazy
    # imports are done before the planning threads use them (concurrent first imports can fail).
    identity = model_info(model).identity
    previous = _previous(output_dir / f"{MANIFEST_NAME}.json")
    stamps = {} if stamps is None else stamps

    def key_of(sha256: str) -> str:
        return run_key(sha256, params, identity)

    def relative_of(source: Path) -> Path | None:
        try:
            return source.relative_to(base)
        except ValueError:
            return None

    def output_of(relative: Path) -> Path:
        return output_dir / relative.parent / output_name(relative, params)

    def plan_one(source: Path) -> Any:
        relative = relative_of(source)
        try:
            if relative is not None and not overwrite:
                quick = _unchanged(source, relative.as_posix(), output_of(relative), key_of, previous)
                if quick is not None:
                    return quick
            # Scene cuts are found as the clip is ingested, beside an earlier clip's model work, not before any.
            prepared = prepare_run(source, params, model, store_root, find_cuts=False)
            return prepared, _stamp(source)
        except Exception as err:  # noqa: BLE001 - a bad file is reported in its row, the others go on
            return err

    with ThreadPoolExecutor(max_workers=max(1, min(PLAN_THREADS, len(sources)))) as pool:
        prepared = list(pool.map(plan_one, sources))
    claimed: dict[Path, str] = {}
    rows = []
    plans: dict[str, PreparedRun] = {}
    for source, result in zip(sources, prepared, strict=True):
        relative = relative_of(source)
        if relative is None:
            rows.append(
                ArchiveRow(
                    source=str(source),
                    relative_path=source.name,
                    status="skipped",
                    reason=f"not inside the input folder {base}",
                )
            )
            continue
        output = output_of(relative)
        row = ArchiveRow(source=str(source), relative_path=relative.as_posix(), status="planned", output=str(output))
        if isinstance(result, BaseException):
            rows.append(row.model_copy(update={"status": "skipped", "reason": _describe(result), "output": ""}))
            continue
        if isinstance(result, ArchiveRow):  # unchanged since an earlier run made its output
            stamps[row.relative_path] = previous.sources[row.relative_path]
            if output in claimed:
                reason = f"its output {output} is already the output of {claimed[output]}"
                update = {"status": "skipped", "output": "", "reason": reason, "tiles_computed": None}
                rows.append(result.model_copy(update={**update, "tiles_reused": None}))
                continue
            claimed[output] = row.relative_path
            rows.append(result)
            continue
        result, stamps[row.relative_path] = result
        items = result.plan.num_windows * result.plan.num_tiles  # every (window, tile) item, as the run counts
        row = row.model_copy(update={"run_key": result.run.run_key, "frames": result.plan.num_frames, "tiles": items})
        if output in claimed:
            reason = f"its output {output} is already the output of {claimed[output]}"
            rows.append(row.model_copy(update={"status": "skipped", "output": "", "reason": reason}))
            continue
        claimed[output] = row.relative_path
        if output.is_file() and not overwrite:
            # A reused row keeps the run key that made its output, so a changed request is reported on every rerun.
            earlier_row = previous.rows.get(row.relative_path)
            earlier = earlier_row.run_key if earlier_row else row.run_key
            reason = "output exists"
            if earlier != row.run_key:
                reason = (
                    f"output exists, made by run {earlier} but this request is run {row.run_key} (the source, "
                    "parameters or model changed); overwrite replaces it"
                )
            rows.append(
                row.model_copy(
                    update={
                        "status": "reused",
                        "reason": reason,
                        "run_key": earlier,
                        "tiles_computed": 0,
                        "tiles_reused": row.tiles,
                    }
                )
            )
        else:
            reason = "finished run in the store: only the output is written" if result.finished else ""
            rows.append(row.model_copy(update={"reason": reason}))
            plans[row.relative_path] = result
    return rows, plans


# ------------------------------------------------------------------------------------------------ manifest


def counts_of(rows: list[ArchiveRow]) -> dict[str, int]:
    counted = Counter(row.status for row in rows)
    return {status: counted[status] for status in STATUSES if counted[status]}


def message_of(rows: list[ArchiveRow], plan_only: bool) -> str:
    if not rows:
        return "no clips found"
    counts = counts_of(rows)
    listed = ", ".join(f"{n} {status}" for status, n in counts.items())
    if plan_only:
        return f"plan only, nothing run: {listed}"
    if not any(counts.get(status) for status in ("done", "failed", "planned")):
        return f"nothing new to do: {listed}"
    return listed


def write_manifest(output_dir: Path, header: dict[str, Any], rows: list[ArchiveRow]) -> tuple[Path, Path]:
    """The manifest as JSON (header, counts, rows) and CSV (rows), each replaced atomically."""
    json_path = output_dir / f"{MANIFEST_NAME}.json"
    csv_path = output_dir / f"{MANIFEST_NAME}.csv"
    payload = {
        **header,
        "updated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "counts": counts_of(rows),
        "rows": [row.model_dump(mode="json") for row in rows],
    }
    atomic_write_bytes(json_path, json.dumps(payload, indent=2).encode())
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(ArchiveRow.model_fields), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: "" if value is None else value for key, value in row.model_dump(mode="json").items()})
    atomic_write_bytes(csv_path, buffer.getvalue().encode())
    return json_path, csv_path


# ------------------------------------------------------------------------------------------------ the UI


def manifest_markdown(header: dict[str, Any], rows: list[ArchiveRow], clip_runs: dict[str, str], message: str) -> str:
    """The manifest as one table: the clip (linked to its run), its status, tiles and seconds first, so that they
    fit a laptop screen; then the output (relative to the output folder), the run key and the reason."""
    out_dir = Path(header["output_dir"])

    def clip(row: ArchiveRow) -> str:
        name = row.relative_path.replace("[", "\\[").replace("]", "\\]")
        run_id = clip_runs.get(row.relative_path)
        return f"[{name}]({artifacts.flow_run_url(run_id)})" if run_id else name

    def output(row: ArchiveRow) -> str:
        path = Path(row.output)
        return path.relative_to(out_dir).as_posix() if row.output and path.is_relative_to(out_dir) else row.output

    def reason(row: ArchiveRow) -> str:
        # A file's error names the file first; the row already does.
        return row.reason.removeprefix(f"{row.source}: ")

    table = artifacts.markdown_table(
        ["clip", "status", "tiles", "computed", "reused", "seconds", "output", "run key", "reason"],
        [
            [
                clip(row),
                row.status,
                row.tiles,
                row.tiles_computed,
                row.tiles_reused,
                "" if row.seconds is None else f"{row.seconds:.1f}",
                output(row),
                row.run_key[:12],
                reason(row),
            ]
            for row in rows
        ],
        align="llrrrr",
    )
    updated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return (
        f"# Archive {Path(header['input']).name}\n\n"
        f"`{header['input']}` to `{out_dir}`: {message}. Updated {updated}; the manifest files are "
        f"`{out_dir / MANIFEST_NAME}.json` and `.csv`.\n\n{table}\n"
    )


class ManifestArtifact:
    """The archive run's one manifest artifact, rewritten in place: the run never lists a stale version."""

    def __init__(self, archive: str, flow_run_id: str | None, header: dict[str, Any]) -> None:
        self.key, self.flow_run_id, self.header = f"archive-manifest-{archive}", flow_run_id, header
        self._id: UUID | None = None

    def show(self, rows: list[ArchiveRow], clip_runs: dict[str, str]) -> None:
        message = message_of(rows, self.header["plan_only"])
        markdown = manifest_markdown(self.header, rows, clip_runs, message)
        if self._id is None:
            self._id = artifacts.create("markdown", self.key, markdown, message, self.flow_run_id)
        else:
            artifacts.update(self._id, markdown, message)


# ------------------------------------------------------------------------------------------------ run


@contextlib.contextmanager
def shared_tiles_cluster(
    workers: int, gpus: bool, dask_address: str | None, own: str | None = None
) -> Iterator[str | None]:
    """The Dask scheduler every clip sends its tiles to: the given one, the warm workers, one started here (asked
    for, or with `own`, the model to load, the archive's own split cluster), or None (threads)."""
    dask_address = resolve_address(workers, gpus, dask_address)
    if dask_address:
        yield dask_address
        return
    if not uses_processes(workers, gpus, None):
        if own is None:
            yield None
            return
        with split_cluster(own) as cluster:
            yield cluster.scheduler_address
        return
    cluster = start_cluster(workers, gpus)
    with cluster:
        yield cluster.scheduler_address


# The name of the clip run a thread of the archive is starting: the clip's path relative to the archive's input.
CLIP_RUN_NAME: contextvars.ContextVar[str] = contextvars.ContextVar("k6vsr_clip_run_name", default="upscale-clip")


def _clip_run_name() -> str:
    return CLIP_RUN_NAME.get()


def clip_flow_of_archive(dask_address: str | None = None) -> Flow[..., ClipSummary]:
    """The clip flow as an archive runs it, made once per archive: a flow's options rebuild its parameters' schema
    (55 ms a clip); the run's name comes from `CLIP_RUN_NAME`."""
    return upscale_clip.with_options(flow_run_name=_clip_run_name, task_runner=make_task_runner(1, dask_address, False))


@contextlib.contextmanager
def clip_runs_without_heartbeats() -> Iterator[None]:
    """Clip runs started in the block (in threads that copy its context) send no heartbeats of their own.

    Prefect joins a flow run's heartbeat thread as the run ends, and that thread looks for its stop once a second:
    half a second a clip on average, while the clip thread holds its slot. The archive run's own heartbeats go on
    (its engine read the setting as it started), so a killed archive still stops beating, and each clip run's lease
    (runtime.flow_leases) marks it Crashed once its process is gone.
    """
    from prefect.settings import temporary_settings

    with temporary_settings(updates={"flows.heartbeat_frequency": None}):
        yield


def upscale_one(
    relative_path: str, output: str, prepared: PreparedRun, model: ModelSpec, clip_flow: Flow[..., ClipSummary]
) -> tuple[str, ClipSummary | Exception]:
    """Run `clip_flow` (`clip_flow_of_archive`) on the clip's plan, as a subflow of this flow run, named after the
    clip.

    Returns the clip's flow run id and its summary, or the error it failed with. Called straight from the archive
    flow, not from a task: the clip run's artifacts then belong to the clip run alone.
    """
    named = CLIP_RUN_NAME.set(f"upscale-{relative_path}")
    try:
        # A state, as `return_state` asks; Prefect's overloads give a flow of unnamed parameters its result's type.
        state = cast("State[ClipSummary]", clip_flow(prepared=prepared, output=output, model=model, return_state=True))
    finally:
        CLIP_RUN_NAME.reset(named)
    try:
        return str(state.state_details.flow_run_id), state.result()
    except Exception as err:  # noqa: BLE001 - the clip failed: its row says why, the others go on
        return str(state.state_details.flow_run_id), err


@flow(name="upscale-archive", flow_run_name=_flow_run_name, log_prints=False, validate_parameters=True)
@leased  # a run whose process is killed is marked Crashed by the next command
def upscale_archive(
    input_dir: str | None = None,
    output_dir: str = "k6vsr-archive",
    paths: list[str] | None = None,
    params: UpscaleParams = UpscaleParams(),
    model: ModelSpec = ModelSpec(),
    store_root: str | None = None,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    max_parallel: int = ARCHIVE_CLIPS_IN_FLIGHT,
    overwrite: bool = False,
    plan_only: bool = False,
    workers: int = 1,
    gpus: bool = False,
    dask_address: str | None = None,
) -> ArchiveSummary:
    """Upscale every clip of `input_dir` (a folder, or a text file of paths) or of `paths` into `output_dir`.

    `include`/`exclude` are globs on the path relative to `input_dir` or on the file name (default include: common
    video extensions; an explicit path list is taken as given). `workers`, `gpus` and `dask_address` say where the
    tiles of every clip run, as for one clip; `max_parallel` clips run at once.
    """
    logger = get_run_logger()
    root = str(parse_store_root(store_root) if store_root else default_store_root())
    out_dir = Path(output_dir).expanduser().resolve()
    out_dir.mkdir(parents=True, exist_ok=True)

    # 1-2. Scan and plan every clip.
    base, sources = _sources(input_dir, paths, out_dir, list(include or VIDEO_GLOBS), list(exclude or []))
    logger.info("planning %d clips of %s", len(sources), base)
    stamps: dict[str, SourceStamp] = {}
    rows, plans = plan_clips(base, sources, out_dir, params, model, root, overwrite, stamps)
    header = archive_header(base, out_dir, root, params, model, plan_only)
    header["sources"] = {path: stamp.model_dump() for path, stamp in stamps.items()}
    manifest_json, manifest_csv = write_manifest(out_dir, header, rows)
    for row in rows:
        if row.status == "skipped":
            logger.warning("skipped %s: %s", row.relative_path, row.reason)
    pending = [i for i, row in enumerate(rows) if row.status == "planned"]
    slug = archive_slug(input_dir, paths)
    manifest_artifact = ManifestArtifact(slug, flow_run.id, header)
    if plan_only or not pending:
        manifest_artifact.show(rows, {})
        logger.info("%s", message_of(rows, plan_only))
        return _summary(base, out_dir, rows, plan_only, manifest_json, manifest_csv)

    # 3. Run the pending clips, max_parallel at once, each as its own clip flow run.
    logger.info("running %d of %d clips, %d at once", len(pending), len(rows), max_parallel)
    progress = artifacts.ArchiveProgress(slug, flow_run.id, len(pending))
    manifest_artifact.show(rows, {})
    computing = [plans[rows[i].relative_path] for i in pending if not plans[rows[i].relative_path].finished]
    own = model.model_dump_json() if computing and own_processes(model.device) else None
    with shared_tiles_cluster(workers, gpus, dask_address, own) as address:
        if address is None and computing:  # the tiles compute in this process: load it beside the first clip's start
            preload_in_background(model, computing[0].plan)
        run_clips(rows, pending, plans, model, address, max_parallel, out_dir, header, manifest_artifact, progress)

    summary = _summary(base, out_dir, rows, plan_only, manifest_json, manifest_csv)
    logger.info("%s; manifest %s", summary.message, manifest_json)
    if summary.failed:
        # The run is Failed and its state still carries the summary (`state.result(raise_on_failure=False)`).
        return Failed(  # type: ignore[return-value]
            message=f"{summary.counts['failed']} of {len(rows)} clips failed ({summary.message}); "
            f"see {manifest_json}. Rerun the archive to retry them: finished clips are reused",
            data=summary,
        )
    return summary


def archive_header(
    base: Path, out_dir: Path, root: str, params: UpscaleParams, model: ModelSpec, plan_only: bool
) -> dict[str, Any]:
    """What the manifest says of the whole archive, above its rows."""
    return {
        "input": str(base),
        "output_dir": str(out_dir),
        "store_root": root,
        "params": params.model_dump(mode="json"),
        # What every output of this archive is written as (each clip's exact rate is in its run's plan).
        "output_format": {**params.encoding.describe(), "audio": params.audio, "fps_mode": params.fps_mode},
        "model": model.model_dump(mode="json"),
        "plan_only": plan_only,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def run_clips(
    rows: list[ArchiveRow],
    pending: list[int],
    plans: dict[str, PreparedRun],
    model: ModelSpec,
    address: str | None,
    max_parallel: int,
    out_dir: Path,
    header: dict[str, Any],
    manifest_artifact: ManifestArtifact,
    progress: artifacts.ArchiveProgress,
) -> None:
    """Run the clips of `rows` at `pending`, `max_parallel` at once, each as a subflow of this flow run: every row is
    updated as its clip ends, and the manifest written and shown again."""
    logger = get_run_logger()
    clip_runs: dict[str, str] = {}  # relative path -> the clip's flow run id
    last_table = time.monotonic()

    # A thread pool, not Prefect's own fan-out: a subflow runs in the thread that calls it (prefect 3.9), and
    # `Flow.submit` sends a flow to a work pool's infrastructure, a new process per run that loads the model again;
    # a concurrency limit bounds runs but starts none; and a clip run started from a task would file its artifacts
    # under that task (flows.artifacts).
    shared = SharedQueue()
    clip_flow = clip_flow_of_archive(address)

    def run(index: int) -> tuple[int, ArchiveRow, float, str | None]:
        """The clip's finished row. Its summary (its quality report with it) or its error (with the frames of its
        traceback) is dropped here, not kept by the list of futures for as long as the archive runs."""
        row = rows[index]
        ARCHIVE_QUEUE.set((shared, index))  # this clip's model work after every earlier clip's, before later ones'
        progress.started(row.relative_path, plans[row.relative_path].run.open())
        started = time.perf_counter()
        for attempt in range(1 + API_BUSY_RETRIES):
            try:
                clip_run, outcome = upscale_one(
                    row.relative_path, row.output, plans[row.relative_path], model, clip_flow
                )
            except Exception as err:  # noqa: BLE001 - one bad clip never stops the others
                clip_run, outcome = None, err
            if attempt == API_BUSY_RETRIES or not api_busy(outcome):
                break
            logger.warning("clip %s: the Prefect API was busy (%s); running it again", row.relative_path, outcome)
            time.sleep(API_BUSY_PAUSE_S)
        seconds = time.perf_counter() - started
        return index, _finished_row(row, seconds, outcome), seconds, clip_run

    with (
        progress.watching(),
        clip_runs_without_heartbeats(),
        ThreadPoolExecutor(max_workers=max(1, max_parallel), thread_name_prefix="archive-clip") as pool,
    ):
        # Each clip runs in a copy of this flow run's context, so its flow run is a subflow of this run.
        futures = [pool.submit(contextvars.copy_context().run, run, index) for index in pending]
        for finished, future in enumerate(as_completed(futures), start=1):
            index, row, seconds, clip_run = future.result()
            rows[index] = row
            if clip_run is not None:
                clip_runs[row.relative_path] = clip_run
            progress.finished(row.relative_path, failed=row.status == "failed")
            if row.status == "failed":
                logger.error("clip %s failed: %s", row.relative_path, row.reason)
            else:
                logger.info(
                    "clip %s done in %.1f s (%s tiles computed, %s reused)",
                    row.relative_path,
                    seconds,
                    row.tiles_computed,
                    row.tiles_reused,
                )
            write_manifest(out_dir, header, rows)
            if time.monotonic() - last_table >= TABLE_EVERY_S or finished == len(pending):
                manifest_artifact.show(rows, clip_runs)
                last_table = time.monotonic()


# A clip whose run failed because the Prefect API answered busy (SQLite locked past its timeout under load answers
# 503, after the client's own retries) is run again, in a new flow run, after a pause: its finished work is in the
# store, so only the rest is computed. Seen at 2 or 3 clips in 200 on a loaded 2-core machine (bench/RESULTS.md).
API_BUSY_RETRIES = 2
API_BUSY_PAUSE_S = 5.0
API_BUSY_STATUSES = (429, 502, 503, 504)


def api_busy(outcome: Any) -> bool:
    """The outcome is the Prefect API's busy answer, not the clip's own failure."""
    from prefect.exceptions import PrefectHTTPStatusError

    return isinstance(outcome, PrefectHTTPStatusError) and outcome.response.status_code in API_BUSY_STATUSES


def _finished_row(row: ArchiveRow, seconds: float, outcome: Any) -> ArchiveRow:
    if isinstance(outcome, BaseException):
        return row.model_copy(update={"status": "failed", "reason": _describe(outcome), "seconds": round(seconds, 3)})
    return row.model_copy(
        update={
            "status": "done",
            "reason": "published from the finished run in the store" if outcome.reused_output else "",
            "run_key": outcome.run_key,
            "frames": outcome.frames,
            "tiles": outcome.tiles_total,
            "tiles_computed": outcome.tiles_computed,
            "tiles_reused": outcome.tiles_reused,
            "seconds": round(seconds, 3),
            "output": outcome.output,
        }
    )


def _summary(
    base: Path, out_dir: Path, rows: list[ArchiveRow], plan_only: bool, manifest_json: Path, manifest_csv: Path
) -> ArchiveSummary:
    counts = counts_of(rows)
    return ArchiveSummary(
        input=str(base),
        output_dir=str(out_dir),
        counts=counts,
        message=message_of(rows, plan_only),
        manifest_json=str(manifest_json),
        manifest_csv=str(manifest_csv),
        failed=bool(counts.get("failed")),
        rows=rows,
    )
