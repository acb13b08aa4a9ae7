"""Completion records and atomic files: how the store knows that a stage is done, and that its bytes are intact.

A stage is done only when its record exists. The record is written last, atomically (temporary file, fsync,
rename), and carries the SHA-256 of the bytes it covers, so a torn or corrupted chunk is detected on read and
recomputed instead of being blended. Zarr attributes are never used for this: concurrent attribute writes lose keys.
"""

from __future__ import annotations

import hashlib
import json
import os
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


class RecordBook:
    """The records of one run: `done/<stage>/<item>.json`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, stage: str, item: str) -> Path:
        return self.root / stage / f"{item}.json"

    def write(self, stage: str, item: str, checksum: str, seconds: float = 0.0, attempt: str = "") -> CompletionRecord:
        record = CompletionRecord(
            stage=stage, item=item, checksum=checksum, seconds=seconds, written_at=time.time(), attempt=attempt
        )
        atomic_write_json(self.path(stage, item), record.model_dump())
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
