"""Every clip of an archive planned without loading a model, and what an earlier run into the same output folder
lets a rerun skip."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from flows.archive.report import MANIFEST_NAME
from flows.archive.rows import ArchiveRow, reason_of
from k6vsr_core.contract.params import UpscaleParams, output_name
from service.runs import ModelSpec, PreparedRun, model_info, prepare_run
from storage import run_key, source_info

PLAN_THREADS = 8


class SourceStamp(BaseModel):
    """What the manifest remembers of a planned source: enough to know, without reading it, that it is unchanged."""

    size: int
    mtime_ns: int
    sha256: str


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
            rows.append(row.model_copy(update={"status": "skipped", "reason": reason_of(result), "output": ""}))
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
