"""The archive's manifest: its files (JSON and CSV, one row per clip) and its table in the Prefect UI."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import UUID

from flows import artifacts
from flows.archive.rows import ArchiveRow, counts_of, message_of
from k6vsr_core.contract.params import UpscaleParams
from service.runs import ModelSpec
from storage.records import atomic_write_bytes

MANIFEST_NAME = "k6vsr-archive-manifest"


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
