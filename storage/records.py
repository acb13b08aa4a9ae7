"""Completion records and atomic files: how the store knows that a stage is done, and that its bytes are intact.

A stage is done only when its record exists. The record is written last, atomically (temporary file, fsync,
rename), and carries the SHA-256 of the bytes it covers, so a torn or corrupted chunk is detected on read and
recomputed instead of being blended. Zarr attributes are never used for this: concurrent attribute writes lose keys.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, payload: Any) -> None:
    atomic_write_bytes(path, json.dumps(payload, indent=2, sort_keys=True).encode())


def array_checksum(array: np.ndarray) -> str:
    """SHA-256 over dtype, shape and the C-ordered bytes."""
    contiguous = np.ascontiguousarray(array)
    digest = hashlib.sha256(f"{contiguous.dtype.str}{contiguous.shape}".encode())
    digest.update(memoryview(contiguous).cast("B"))
    return digest.hexdigest()


def file_checksum(path: Path, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


class CompletionRecord(BaseModel):
    stage: str
    item: str
    checksum: str
    seconds: float = 0.0
    written_at: float
    attempt: str = ""  # the run attempt that wrote it (a flow-run id): what this attempt computed, not reused


def _cuda_peak_gib() -> float | None:
    """The process's peak reserved CUDA memory so far, where torch is loaded and CUDA in use; None elsewhere.

    Read through `sys.modules` so that the store never imports torch itself."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return round(torch.cuda.max_memory_reserved() / 2**30, 2)


class RecordBook:
    """The records of one run: `done/<stage>/<item>.json`, and `timeline.jsonl` beside `done/`: one line per computed
    item (stage, item, wall-clock start and end, process, peak CUDA memory), appended as its record is written, so
    that when each task ran and what it held can be read back after the run (the device check does)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.timeline = root.parent / "timeline.jsonl"

    def path(self, stage: str, item: str) -> Path:
        return self.root / stage / f"{item}.json"

    def write(self, stage: str, item: str, checksum: str, seconds: float = 0.0, attempt: str = "") -> CompletionRecord:
        record = CompletionRecord(
            stage=stage, item=item, checksum=checksum, seconds=seconds, written_at=time.time(), attempt=attempt
        )
        atomic_write_json(self.path(stage, item), record.model_dump())
        if seconds > 0:
            line = {"stage": stage, "item": item, "start": record.written_at - seconds, "end": record.written_at}
            line.update(pid=os.getpid(), cuda_peak_gib=_cuda_peak_gib(), attempt=attempt)
            # One write of one short line in append mode: lines from concurrent tasks never interleave.
            with open(self.timeline, "a", encoding="utf-8") as log:
                log.write(json.dumps(line) + "\n")
        return record

    def read(self, stage: str, item: str) -> CompletionRecord | None:
        """The record, or None when it is missing or unreadable (a damaged record means 'not done')."""
        path = self.path(stage, item)
        try:
            return CompletionRecord.model_validate_json(path.read_bytes())
        except (OSError, ValidationError, ValueError):
            return None

    def drop(self, stage: str, item: str) -> None:
        self.path(stage, item).unlink(missing_ok=True)

    def items(self, stage: str) -> list[str]:
        folder = self.root / stage
        return sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
