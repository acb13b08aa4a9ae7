"""Completion records and atomic files: how the store knows that a stage is done, and that its bytes are intact.

A stage is done only when its record exists. The record is written last, atomically (temporary file, fsync,
rename; in an object store, one whole object), and carries the SHA-256 of the bytes it covers, so a torn or
corrupted chunk is detected on read and recomputed instead of being blended. The record is sealed with the SHA-256
of its own fields, so a flipped bit that leaves it valid JSON (a digit of its checksum, of its attempt) is caught
too; records of older stores, written before the seal, are read as they are. A damaged record or chunk is logged as
a warning on `k6vsr.store` naming it, then treated as not done. Zarr attributes are never used for this: concurrent
attribute writes lose keys.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError

from k6vsr_core.contract.stage_names import Stage
from storage.location import LocalLocation, Location, atomic_write_bytes, file_checksum

log = logging.getLogger("k6vsr.store")

__all__ = [
    "CompletionRecord",
    "RecordBook",
    "array_checksum",
    "atomic_write_bytes",
    "atomic_write_json",
    "file_checksum",
]


def _json(payload: Any) -> bytes:
    return json.dumps(payload, indent=2, sort_keys=True).encode()


def atomic_write_json(path: Path, payload: Any) -> None:
    atomic_write_bytes(path, _json(payload))


def array_checksum(array: np.ndarray) -> str:
    """SHA-256 over dtype, shape and the C-ordered bytes."""
    contiguous = np.ascontiguousarray(array)
    digest = hashlib.sha256(f"{contiguous.dtype.str}{contiguous.shape}".encode())
    digest.update(contiguous.data.cast("B"))
    return digest.hexdigest()


class CompletionRecord(BaseModel):
    stage: Stage
    item: str
    checksum: str
    seconds: float = 0.0
    written_at: float
    attempt: str = ""  # the run attempt that wrote it (a flow-run id): what this attempt computed, not reused
    seal: str = ""  # SHA-256 of the other fields (`sealed`); empty in records written before seals

    def sealed(self) -> CompletionRecord:
        return self.model_copy(update={"seal": _seal(self)})

    def intact(self) -> bool:
        return not self.seal or self.seal == _seal(self)


def _seal(record: CompletionRecord) -> str:
    return hashlib.sha256(_json(record.model_dump(exclude={"seal"}))).hexdigest()


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
    that when each task ran and what it held can be read back after the run (the device check does). An object
    store cannot append: there each line is its own object, `timeline/<stage>-<item>-<attempt>.json`."""

    def __init__(self, root: Path | Location) -> None:
        self.root = root if isinstance(root, Location) else LocalLocation(root)

    def location(self, stage: Stage, item: str) -> Location:
        return self.root / stage / f"{item}.json"

    def path(self, stage: Stage, item: str) -> Path:
        """The record's file, in a local store."""
        return self.location(stage, item).local()

    def folders(self) -> list[Path]:
        """The local folders that hold records, a stage's each (none in an object store, whose writes are whole
        objects)."""
        if self.root.remote or not self.root.local().is_dir():
            return []
        return [p for p in self.root.local().iterdir() if p.is_dir()]

    def write(
        self, stage: Stage, item: str, checksum: str, seconds: float = 0.0, attempt: str = ""
    ) -> CompletionRecord:
        record = CompletionRecord(
            stage=stage, item=item, checksum=checksum, seconds=seconds, written_at=time.time(), attempt=attempt
        ).sealed()
        self.location(stage, item).write_bytes(_json(record.model_dump()))
        if seconds > 0:
            line = {"stage": stage, "item": item, "start": record.written_at - seconds, "end": record.written_at}
            line.update(pid=os.getpid(), cuda_peak_gib=_cuda_peak_gib(), attempt=attempt)
            self._log(line)
        return record

    def _log(self, line: dict[str, Any]) -> None:
        if not self.root.remote:
            # One write of one short line in append mode: lines from concurrent tasks never interleave.
            with open(self.root.local().parent / "timeline.jsonl", "a", encoding="utf-8") as log:
                log.write(json.dumps(line) + "\n")
        else:
            name = f"{line['stage']}-{line['item']}-{line['attempt'] or line['pid']}.json"
            (self.root.parent / "timeline" / name).write_bytes(json.dumps(line).encode())

    def computed(self, attempt: str) -> dict[str, set[str]]:
        """The items each stage computed in `attempt`, by stage, from the timeline (an item a retry computed again
        counts once); the items it found done are in no line of it."""
        computed: dict[str, set[str]] = {}
        for line in self._lines(f"-{attempt}.json"):
            if line.get("attempt") == attempt and isinstance(line.get("stage"), str):
                computed.setdefault(line["stage"], set()).add(str(line.get("item")))
        return computed

    def timeline(self) -> list[dict[str, Any]]:
        """Every line of the run's timeline, of every attempt (a line cut short by a killed process left out)."""
        return self._lines(".json")

    def _lines(self, suffix: str) -> list[dict[str, Any]]:
        if not self.root.remote:
            try:
                text = (self.root.local().parent / "timeline.jsonl").read_text(encoding="utf-8")
            except FileNotFoundError:
                return []
            blobs = text.splitlines()
        else:
            folder = self.root.parent / "timeline"
            blobs = [(folder / name).read_bytes().decode() for name in folder.names(suffix)]
        lines = []
        for blob in blobs:
            try:
                line = json.loads(blob)
            except ValueError:  # a line cut short by a killed process
                continue
            if isinstance(line, dict):
                lines.append(line)
        return lines

    def read(self, stage: Stage, item: str) -> CompletionRecord | None:
        """The record, or None when it is missing or damaged (a damaged record means 'not done', with a warning)."""
        where = self.location(stage, item)
        try:
            data = where.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            damaged(where, f"the completion record of {stage} {item} cannot be read ({err})")
            return None
        try:
            record = CompletionRecord.model_validate_json(data)
        except (ValidationError, ValueError):
            damaged(where, f"the completion record of {stage} {item} is damaged (not a record)")
            return None
        if not record.intact() or (record.stage, record.item) != (stage, item):
            damaged(where, f"the completion record of {stage} {item} is damaged (its seal does not match)")
            return None
        return record

    def drop(self, stage: Stage, item: str) -> None:
        self.location(stage, item).remove()

    def items(self, stage: Stage) -> list[str]:
        return sorted(name.removesuffix(".json") for name in (self.root / stage).names(".json"))


def damaged(where: Location | Path, what: str) -> None:
    """Say that stored bytes failed their check and will be computed again."""
    log.warning("%s: %s; computing it again", where, what)
