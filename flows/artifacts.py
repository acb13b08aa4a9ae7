"""What a clip run shows in the Prefect UI: tile progress, and a final report with a before/after still."""

from __future__ import annotations

import base64
import io
from uuid import UUID

import numpy as np
from PIL import Image
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

THUMB_WIDTH = 320


def artifact_key(prefix: str, run_key: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return f"{prefix}-{run_key[:12]}".lower()


def start_progress(run_key: str, total: int) -> UUID | None:
    return create_progress_artifact(
        progress=0.0, key=artifact_key("tiles", run_key), description=f"tiles decoded of {total}"
    )


def set_progress(artifact_id: UUID | None, done: int, total: int) -> None:
    if artifact_id is not None:
        update_progress_artifact(artifact_id=artifact_id, progress=100.0 * done / max(1, total))


def _thumbnail(frame: np.ndarray) -> str:
    image = Image.fromarray(frame)
    height = max(1, round(image.height * THUMB_WIDTH / image.width))
    buffer = io.BytesIO()
    image.resize((THUMB_WIDTH, height), Image.Resampling.BICUBIC).save(buffer, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def report_markdown(
    source_name: str,
    before: np.ndarray,
    after: np.ndarray,
    timings: dict[str, float],
    tiles_computed: int,
    tiles_reused: int,
    output: str,
    note: str = "",
) -> str:
    rows = "\n".join(f"| {stage} | {seconds:.2f} |" for stage, seconds in timings.items())
    return (
        f"# {source_name}\n\n{note}\n\n"
        f"| before ({before.shape[1]}x{before.shape[0]}) | after ({after.shape[1]}x{after.shape[0]}) |\n|---|---|\n"
        f"| ![before]({_thumbnail(before)}) | ![after]({_thumbnail(after)}) |\n\n"
        f"| stage | seconds |\n|---|---|\n{rows}\n\n"
        f"| tiles computed | tiles reused |\n|---|---|\n| {tiles_computed} | {tiles_reused} |\n\n"
        f"Output: `{output}`\n"
    )


def publish_report(run_key: str, markdown: str) -> None:
    create_markdown_artifact(markdown=markdown, key=artifact_key("clip-report", run_key), description="before/after")
