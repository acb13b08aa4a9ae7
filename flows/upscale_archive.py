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

The flow is this module; its parts are in `flows/archive/`: `sources` (1), `planning` (2), `clip_runs` (3), `report`
(the manifest files and table) and `rows` (a clip's row and what the rows add up to).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Failed

from flows import artifacts
from flows.archive.clip_runs import run_clips, shared_tiles_cluster
from flows.archive.planning import SourceStamp, plan_clips
from flows.archive.report import ManifestArtifact, archive_header, write_manifest
from flows.archive.rows import ArchiveRow, ArchiveSummary, counts_of, message_of
from flows.archive.sources import VIDEO_GLOBS, find_sources
from k6vsr_core.contract.params import UpscaleParams
from runtime.flow_leases import LEASE_HOOKS, leased
from runtime.runners import own_processes
from runtime.slots import ARCHIVE_CLIPS_IN_FLIGHT
from service.runs import ModelSpec
from storage import default_store_root, parse_store_root
from tasks.worker_preload import preload_in_background


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


@flow(name="upscale-archive", flow_run_name=_flow_run_name, log_prints=False, validate_parameters=True, **LEASE_HOOKS)
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
    base, sources = find_sources(input_dir, paths, out_dir, list(include or VIDEO_GLOBS), list(exclude or []))
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
