"""The HTTP API's job records: a job's record at `<store>/jobs/<id>.json` (written atomically) and its files under
`<store>/jobs/<id>/`, the job ids, the input quota and the bounds a submission can hit.
"""

from __future__ import annotations

import logging
import re
import secrets
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from entrypoints.server.disk import DiskState, is_disk_full

log = logging.getLogger("k6vsr.server")

JOBS = "jobs"
ID_PREFIX = "video_"
_ID = re.compile(r"^video_[A-Za-z0-9_-]{16,64}$")

QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED = "queued", "in_progress", "completed", "failed", "cancelled"
ACTIVE = (QUEUED, IN_PROGRESS)
FINISHED = (COMPLETED, FAILED, CANCELLED)
Status = Literal["queued", "in_progress", "completed", "failed", "cancelled"]


class _Part(BaseModel):
    model_config = ConfigDict(frozen=True)


class JobSource(_Part):
    """Where the job's input came from: `upload`, `latent`, or `path` with the `video_path` relative to its allowed
    folder (shown to the job's owner only)."""

    type: Literal["upload", "latent", "path"]
    video_path: str | None = None


class JobOutput(_Part):
    """The result: planned at submit, measured (`bytes`, `has_audio`) once completed."""

    width: int
    height: int
    frames: int
    fps: int
    has_audio: bool | None
    bytes: int | None
    # The non-square pixels' shape (SAR) written, as a fraction (a 4:3 PAL source's "16/15"); None: square pixels,
    # left out of the answer, which stays as it was before the field.
    sample_aspect: str | None = None
    # Likewise left out where None: the colour tags written where they are not BT.709's (an HDR10 source's
    # "bt2020/smpte2084/bt2020nc/tv"), 16 where the frames pass through the model at 16 bits, and the HDR metadata
    # written, described.
    colour: str | None = None
    pixel_depth: int | None = None
    hdr_metadata: str | None = None

    def answer(self) -> dict[str, object]:
        """As the API answers it: the fields that are None only where they say something are left out."""
        unset = {name for name in OPTIONAL_OUTPUT_FIELDS if getattr(self, name) is None}
        return self.model_dump(mode="json", exclude=unset)

    def with_pixels_of(self, planned: JobOutput | None) -> JobOutput:
        """This result with the planned output's pixel shape, colour, depth and metadata (known at submit only)."""
        if planned is None:
            return self
        return self.model_copy(update={name: getattr(planned, name) for name in OPTIONAL_OUTPUT_FIELDS})


OPTIONAL_OUTPUT_FIELDS = ("sample_aspect", "colour", "pixel_depth", "hdr_metadata")


class JobTiles(_Part):
    """The job's tiles: `computed` and `reused` are None until it completes."""

    total: int
    computed: int | None
    reused: int | None


class JobError(_Part):
    """A failed job's error, as the API answers errors."""

    message: str
    type: str
    code: str


class JobRecord(_Part):
    """One job, as its record file holds it. The file holds the fields that were set (`exclude_unset`): a record
    read and written again is the same JSON, and one written before a field existed still loads. Fields it does not
    know are ignored, and dropped when it is written again."""

    id: str
    object: Literal["video"] = "video"
    model: str
    owner: str | None = None  # the id of the key that submitted it; None on a server without keys
    status: Status
    progress: int = 0
    created_at: int
    created_ns: int = 0  # orders jobs submitted within one second
    started_at: int | None = None
    completed_at: int | None = None
    error: JobError | None = None
    # The run is found by its key, its plan in the run's manifest: the record stays small.
    run_key: str
    request: dict[str, Any]  # the job's UpscaleParams, as JSON
    latent_fps: str | None = None  # a latent's frame rate; None for a clip
    source: JobSource
    output: JobOutput
    tiles: JobTiles
    tiles_found: int | None = None  # tiles its run already held when the job first started
    quality: dict[str, Any] | None = None  # the output's quality report, once completed (docs/processing.md)
    disk_bytes: int | None = None  # what a finished job keeps on disk (its output and its run)

    def changed(self, **changes: Any) -> JobRecord:
        """This record with `changes` applied, validated; a name that is not a field is refused."""
        unknown = sorted(changes.keys() - type(self).model_fields.keys())
        if unknown:
            raise TypeError(f"a job record has no field {', '.join(unknown)}")
        return type(self).model_validate({**self.model_dump(exclude_unset=True), **changes})

    def to_json(self) -> dict[str, Any]:
        """What the record file holds."""
        return self.model_dump(mode="json", exclude_unset=True)


def _write_json(path: Path, payload: Any) -> None:
    """Every file the job store writes (records, the disk probe): atomically."""
    from storage.records import atomic_write_json

    atomic_write_json(path, payload)


# A record's write, repeated on the disk that was full: what tells the store the disk has room again.
DISK_PROBE = ".disk-probe"


def new_job_id() -> str:
    return ID_PREFIX + secrets.token_urlsafe(18)


def valid_job_id(job_id: str) -> bool:
    """Ids come from URLs: anything that is not one of ours never reaches the file system."""
    return bool(_ID.match(job_id))


class QueueFull(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"{limit} jobs are already queued")
        self.limit = limit


class InputQuotaFull(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the inputs of queued and running jobs already take the quota of {limit} bytes")
        self.limit = limit


class _ShareTaken(Exception):
    """A key (or client address) already holds its share of a pool the keys share: `holders` the ones holding any,
    this one counted; `capped`: its share is the per-key limit's, not the pool's split."""

    said: ClassVar[str]  # the message, of the key's `limit`
    cap: ClassVar[str]  # the per-key limit's option
    pool: ClassVar[str]  # what the option --max-queued splits, and what the waiting keys do with it

    def __init__(self, limit: int, holders: int = 1, capped: bool = True) -> None:
        super().__init__(self.said.format(limit=limit))
        self.limit, self.holders, self.capped = limit, holders, capped

    @property
    def why(self) -> str:
        if self.capped:
            return f"its limit ({self.cap})"
        return f"its share of {self.pool.format(holders=self.holders)}"


class KeyQueueFull(_ShareTaken):
    """One key already holds its share of the queue: jobs of its waiting plus its requests being read."""

    said = "this key already has {limit} jobs queued or being sent"
    cap = "--max-queued-per-key"
    pool = "the queue (--max-queued) while {holders} keys or client addresses wait"


class UploadsBusy(_ShareTaken):
    """One key already sends as many request bodies as its share of the upload slots."""

    said = "this key already sends {limit} requests"
    cap = "--max-uploads-per-key"
    pool = "the upload slots (--max-queued) while {holders} keys or client addresses send"


class InputQuota:
    """Bytes of job inputs on disk, charged per job before they are written, so their sum never passes `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._charges: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        with self._lock:
            return sum(self._charges.values())

    def charge(self, job_id: str, size: int) -> None:
        with self._lock:
            if sum(self._charges.values()) + size > self.limit:
                raise InputQuotaFull(self.limit)
            self._charges[job_id] = self._charges.get(job_id, 0) + size

    def count(self, job_id: str, size: int) -> None:
        """Count a file already on disk (found at start), whatever the limit."""
        with self._lock:
            self._charges[job_id] = size

    def release(self, job_id: str) -> None:
        with self._lock:
            self._charges.pop(job_id, None)


class InputFile:
    """One job's input as it is written: at most `cap` bytes, each charged to the quota before it reaches the disk."""

    def __init__(
        self, path: Path, job_id: str, quota: InputQuota, cap: int, too_large: Callable[[], Exception]
    ) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("xb")
        self.job_id, self.quota, self.cap, self.too_large = job_id, quota, cap, too_large
        self.size = 0

    def write(self, data: bytes) -> None:
        if self.size + len(data) > self.cap:
            raise self.too_large()
        self.quota.charge(self.job_id, len(data))
        self.size += len(data)
        self._file.write(data)

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class JobEntry:
    """What listing, cancelling, sharing runs and expiring need of a job, kept in memory: they never read a record
    to decide, so they cost O(jobs they touch), whatever the records hold."""

    id: str
    owner: str | None
    status: str
    run_key: str
    created_ns: int
    completed_at: int | None
    disk_bytes: int  # what a finished job keeps on disk (its output and its run); 0 until it finishes

    @classmethod
    def of(cls, job: JobRecord) -> JobEntry:
        kept = job.model_dump(include={field.name for field in fields(cls)})
        return cls(**{**kept, "disk_bytes": job.disk_bytes or 0})


class JobStore:
    """The job records of one store root, and their index in memory (read once, at start). Every read-modify-write
    holds one lock, so the HTTP handlers and the worker threads never lose each other's updates (one server per
    store)."""

    def __init__(self, store_root: str | Path, input_quota_bytes: int, run_root: str | Path | None = None) -> None:
        self.store_root = Path(store_root)
        # Where the jobs' runs live: the same folder, or an object store (the jobs' own files stay on this disk).
        self.run_root = run_root or self.store_root
        self.root = self.store_root / JOBS
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self.quota = InputQuota(input_quota_bytes)
        self.disk = DiskState()
        self._index: dict[str, JobEntry] = {}
        # Records of known jobs whose write found the disk full: served from here, written once there is room.
        self._unsaved: dict[str, JobRecord] = {}
        for path in self.root.glob(f"{ID_PREFIX}*.json"):
            job = self.get(path.stem)
            if job is not None:
                self._index[job.id] = JobEntry.of(job)

    def record_path(self, job_id: str) -> Path:
        return self.root / f"{job_id}.json"

    def job_dir(self, job_id: str) -> Path:
        return self.root / job_id

    def input_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "input"

    def output_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "output.mp4"

    def get(self, job_id: str) -> JobRecord | None:
        if not valid_job_id(job_id):
            return None
        unsaved = self._unsaved.get(job_id)
        if unsaved is not None:
            return unsaved
        try:
            return JobRecord.model_validate_json(self.record_path(job_id).read_bytes())
        except OSError:
            return None
        except ValidationError as err:  # a torn or foreign file: as if there were none
            log.warning("job %s: its record cannot be read (%d error(s)); skipped", job_id, err.error_count())
            return None

    def put(self, job: JobRecord) -> JobRecord:
        """Write `job`'s record. On a full disk a new job's write raises (its request fails, `disk_full`); a known
        job's record is kept in memory, answered from there and written by `flush_unsaved` once there is room, so
        that a job worker recording how a job ended never fails for want of space."""
        with self.lock:
            try:
                _write_json(self.record_path(job.id), job.to_json())
            except OSError as err:
                if not is_disk_full(err):
                    raise
                self.disk.hit()
                if job.id not in self._index:
                    raise
                log.warning("job %s: its record could not be written (the disk is full); kept in memory", job.id)
                self._unsaved[job.id] = job
            else:
                self.disk.ok()
                self._unsaved.pop(job.id, None)
            self._index[job.id] = JobEntry.of(job)
        return job

    def flush_unsaved(self) -> None:
        """Write the records kept in memory; with none, and the disk found full, try a small write to see whether
        it has room again (what `/health` reports)."""
        with self.lock:
            for job in list(self._unsaved.values()):
                self.put(job)
            if self.disk.full and not self._unsaved:
                try:
                    _write_json(self.root / DISK_PROBE, {"probe": True})
                except OSError as err:
                    if not is_disk_full(err):
                        raise
                else:
                    self.disk.ok()

    def update(self, job_id: str, only_if: tuple[str, ...] | None = None, **changes: Any) -> JobRecord | None:
        """Apply `changes`, fields of `JobRecord` (when the status is in `only_if`, if given); returns the job as it
        is afterwards."""
        with self.lock:
            job = self.get(job_id)
            if job is None:
                return None
            if only_if is None or job.status in only_if:
                job = self.put(job.changed(**changes))
            return job

    def entries(self, owner: str | None = None, everyone: bool = True) -> list[JobEntry]:
        """The index, oldest first: every job's, or (`everyone=False`) those of `owner` only."""
        with self.lock:
            found = [entry for entry in self._index.values() if everyone or entry.owner == owner]
        return sorted(found, key=lambda entry: (entry.created_ns, entry.id))

    def jobs(self, owner: str | None = None, everyone: bool = True) -> list[JobRecord]:
        """The records of `entries(owner, everyone)`: only those are read."""
        found = (self.get(entry.id) for entry in self.entries(owner, everyone))
        return [job for job in found if job is not None]

    def remove(self, job_id: str) -> None:
        """Delete the record and the job's own files (never the shared run store)."""
        with self.lock:
            self.discard_dir(job_id)
            self.record_path(job_id).unlink(missing_ok=True)
            self._index.pop(job_id, None)
            self._unsaved.pop(job_id, None)

    def open_input(self, job_id: str, cap: int, too_large: Callable[[], Exception]) -> InputFile:
        return InputFile(self.input_path(job_id), job_id, self.quota, cap, too_large)

    def drop_input(self, job_id: str) -> None:
        self.input_path(job_id).unlink(missing_ok=True)
        self.quota.release(job_id)

    def discard_dir(self, job_id: str) -> None:
        """Delete the job's own files (its input and output)."""
        shutil.rmtree(self.job_dir(job_id), ignore_errors=True)
        self.quota.release(job_id)

    def recount_inputs(self) -> None:
        """Charge the inputs already on disk, and delete the folders of jobs that were never recorded (a server
        killed during an upload)."""
        for folder in self.root.iterdir():
            if not (folder.is_dir() and valid_job_id(folder.name)):
                continue
            if not self.record_path(folder.name).exists():
                self.discard_dir(folder.name)
            elif self.input_path(folder.name).is_file():
                self.quota.count(folder.name, self.input_path(folder.name).stat().st_size)


# ----------------------------------------------------------------------------------------------- worker slots
