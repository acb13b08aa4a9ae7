"""Jobs of the HTTP API: their records in the store, the queue, and the worker processes that run them.

A job is one run of the clip flow. Its record lives at `<store>/jobs/<id>.json` (written atomically) and its files
under `<store>/jobs/<id>/` (`input` for an upload, `output.mp4` once finished), so a server that was stopped or
killed finds its queued and running jobs again when it starts, and requeues them; since every job runs the resumable
clip flow, the tiles a killed run had finished are reused.

Each worker slot owns one long-lived child process (`python -m entrypoints.jobs`) that imports the pipeline and loads
the model once, then runs jobs one at a time as the parent hands them over a pipe (one JSON line each way). Cancelling a
running job terminates that child: SIGTERM first, so Prefect marks the flow run as crashed, then SIGKILL after a
grace period. Every tile the run had finished stays recorded in the run store. The slot then starts a fresh child.
The child dies with its parent (Linux `PR_SET_PDEATHSIG`, and EOF on its pipe elsewhere), so a killed server leaves
no orphan computing on its own.

What jobs may hold is bounded: at most `max_queued` jobs wait; the inputs on disk (uploads, and the copies of path
sources) are charged to a quota as they are written and freed as soon as a job no longer needs them (once it ran,
or at once when it is cancelled); a cancelled or deleted job's run is reclaimed from the run store unless another
job still refers to it; and finished jobs are deleted `retention_s` after they finished, or sooner, oldest first,
while they keep more than their disk budget. A record holds the request and the run key, never the plan (the child
plans the job's own input again, once), so records, and what the child is handed, stay small.

Why not a deployment of the clip flow, run with `run_deployment` on a work pool whose concurrency is the slots: a
Prefect process worker starts a new process per flow run, which would load the model for every job, where a slot's
child loads it once; and the per-key queue share, the upload slots, the input quota and the retention of finished
jobs are the HTTP API's own bounds, which a work pool does not have. Cancelling still ends in Prefect's terms: the
SIGTERM lets the flow run be marked crashed.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The child process runs this module: it imports only the standard library (and the standard-library-only
# `confine` and `server.memory`) at the top, so that it is bound to its parent before the pipeline's imports
# (seconds on a busy machine) run. The pipeline is imported where it is used.
from entrypoints.confine import scrub_paths
from entrypoints.server.memory import MemoryLedger, own_rss, tree_rss

if TYPE_CHECKING:
    from service.runs import ModelSpec

log = logging.getLogger("k6vsr.server")

JOBS = "jobs"
ID_PREFIX = "video_"
_ID = re.compile(r"^video_[A-Za-z0-9_-]{16,64}$")

QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED = "queued", "in_progress", "completed", "failed", "cancelled"
ACTIVE = (QUEUED, IN_PROGRESS)
FINISHED = (COMPLETED, FAILED, CANCELLED)

TERMINATE_GRACE_S = 3.0
# How often the memory watch measures the server and its worker processes.
MEMORY_WATCH_S = 0.25
# A job's error message, as stored and as answered, is one line of at most this many characters: a library's error
# can be megabytes (one named every parameter of a refused flow run).
MAX_MESSAGE_CHARS = 500


def short_message(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= MAX_MESSAGE_CHARS else line[: MAX_MESSAGE_CHARS - 3] + "..."


def _write_record(path: Path, job: dict[str, Any]) -> None:
    from storage.records import atomic_write_json

    atomic_write_json(path, job)


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


class KeyQueueFull(Exception):
    """One key already holds its share of the queue: jobs of its waiting plus its requests being read."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"this key already has {limit} jobs queued or being sent")
        self.limit = limit


class UploadsBusy(Exception):
    """One key already sends as many request bodies as its share of the admission slots."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"this key already sends {limit} requests")
        self.limit = limit


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
    def of(cls, job: dict[str, Any]) -> JobEntry:
        return cls(
            id=job["id"],
            owner=job.get("owner"),
            status=job["status"],
            run_key=job["run_key"],
            created_ns=job.get("created_ns", 0),
            completed_at=job.get("completed_at"),
            disk_bytes=job.get("disk_bytes") or 0,
        )


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
        self._index: dict[str, JobEntry] = {}
        for path in self.root.glob(f"{ID_PREFIX}*.json"):
            job = self.get(path.stem)
            if job is not None:
                self._index[job["id"]] = JobEntry.of(job)

    def record_path(self, job_id: str) -> Path:
        return self.root / f"{job_id}.json"

    def job_dir(self, job_id: str) -> Path:
        return self.root / job_id

    def input_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "input"

    def output_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "output.mp4"

    def get(self, job_id: str) -> dict[str, Any] | None:
        if not valid_job_id(job_id):
            return None
        try:
            return json.loads(self.record_path(job_id).read_bytes())
        except (OSError, ValueError):
            return None

    def put(self, job: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            _write_record(self.record_path(job["id"]), job)
            self._index[job["id"]] = JobEntry.of(job)
        return job

    def update(self, job_id: str, only_if: tuple[str, ...] | None = None, **changes: Any) -> dict[str, Any] | None:
        """Apply `changes` (when the status is in `only_if`, if given); returns the job as it is afterwards."""
        with self.lock:
            job = self.get(job_id)
            if job is None:
                return None
            if only_if is None or job["status"] in only_if:
                job.update(changes)
                self.put(job)
            return job

    def entries(self, owner: str | None = None, everyone: bool = True) -> list[JobEntry]:
        """The index, oldest first: every job's, or (`everyone=False`) those of `owner` only."""
        with self.lock:
            found = [entry for entry in self._index.values() if everyone or entry.owner == owner]
        return sorted(found, key=lambda entry: (entry.created_ns, entry.id))

    def jobs(self, owner: str | None = None, everyone: bool = True) -> list[dict[str, Any]]:
        """The records of `entries(owner, everyone)`: only those are read."""
        found = (self.get(entry.id) for entry in self.entries(owner, everyone))
        return [job for job in found if job is not None]

    def remove(self, job_id: str) -> None:
        """Delete the record and the job's own files (never the shared run store)."""
        with self.lock:
            self.discard_dir(job_id)
            self.record_path(job_id).unlink(missing_ok=True)
            self._index.pop(job_id, None)

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


class WorkerSlot:
    """One worker thread and its child process."""

    def __init__(self, runner: JobRunner, index: int) -> None:
        self.runner = runner
        self.index = index
        self.process: subprocess.Popen[str] | None = None
        self.current: str | None = None
        self.over_memory: str | None = None  # set by the memory watch when it stops this job: the reason
        self.thread = threading.Thread(target=self._loop, name=f"k6vsr-job-worker-{index}", daemon=True)

    # The thread that starts a child must outlive it: PR_SET_PDEATHSIG fires when that *thread* exits. So only this
    # slot's own thread ever spawns.
    def _spawn(self) -> None:
        command = [sys.executable, "-m", "entrypoints.jobs", self.runner.spec.model_dump_json(), str(os.getpid())]
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # the child's logs go wherever the server's go
            text=True,
            bufsize=1,
            start_new_session=True,  # a terminal's Ctrl-C reaches the server only; the server stops its children
        )

    def _alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _loop(self) -> None:
        try:
            self._spawn()  # warm up before the first job arrives
        except OSError:
            log.exception("worker %d: could not start a worker process; retrying with the first job", self.index)
        while True:
            job_id = self.runner.queue.get()
            if job_id is None or self.runner.stopping.is_set():
                return
            try:
                self._run(job_id)
            except Exception:  # noqa: BLE001 - one bad job must not take the worker down
                log.exception("job %s: unexpected error in the worker", job_id)
                self.runner.store.update(
                    job_id,
                    only_if=ACTIVE,
                    status=FAILED,
                    completed_at=int(time.time()),
                    error={"message": "internal error in the job worker", "type": "server_error", "code": "job_failed"},
                )
            finally:
                self.current = None

    def _run(self, job_id: str) -> None:
        store = self.runner.store
        with store.lock:
            self.runner.waiting.pop(job_id, None)
            job = store.get(job_id)
            if job is None or job["status"] != QUEUED:
                return  # cancelled or deleted while it waited
            self.current = job_id
            found = job.get("tiles_found")
            if found is None:  # a job resumed after a restart keeps the count of its first start
                found = _tiles_decoded(store.run_root, job["run_key"])
            store.update(job_id, status=IN_PROGRESS, started_at=int(time.time()), tiles_found=found)
        if not self._alive():
            self._spawn()
        assert self.process is not None and self.process.stdin is not None and self.process.stdout is not None
        message = job_message(store, job)
        reply: dict[str, Any] | None = None
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
            if (store.get(job_id) or {}).get("status") == CANCELLED:
                self.terminate()  # cancelled between being taken and being handed over
            while reply is None:
                line = self.process.stdout.readline()
                if not line:
                    break  # the child exited: cancelled, stopping, or crashed
                event = json.loads(line)
                if event.get("event") in ("done", "failed", "fatal"):
                    reply = event
        except (BrokenPipeError, OSError, ValueError):
            reply = None
        self._finish(job_id, reply)

    def _finish(self, job_id: str, reply: dict[str, Any] | None) -> None:
        store = self.runner.store
        now = int(time.time())
        if reply is None:  # the child died under this job: cancelled, stopping, or crashed
            code = self._reap()
            _mark_crashed_runs()
            if self.runner.stopping.is_set():
                return  # stays in_progress, input kept: the next server start resumes it
            error = {
                "message": f"the worker process exited (code {code}) during the job; resubmit the same "
                "request to resume from its finished tiles",
                "type": "server_error",
                "code": "worker_exited",
            }
            if self.over_memory is not None:
                error = {"message": self.over_memory, "type": "invalid_request_error", "code": "memory_exceeded"}
                self.over_memory = None
            store.update(job_id, only_if=(IN_PROGRESS,), status=FAILED, completed_at=now, error=error)
            self._spawn()  # warm up the next child while the queue is idle
        elif reply["event"] == "done":
            summary = reply["summary"]
            width, height = summary["size"]
            output = store.output_path(job_id)
            written = output.stat().st_size if output.is_file() else None
            store.update(
                job_id,
                only_if=(IN_PROGRESS,),
                status=COMPLETED,
                progress=100,
                completed_at=now,
                run_key=summary["run_key"],
                output={
                    "width": width,
                    "height": height,
                    "frames": summary["frames"],
                    "fps": summary["fps"],
                    "has_audio": reply.get("has_audio"),
                    "bytes": written,
                },
                tiles=tile_counts(summary, (store.get(job_id) or {}).get("tiles_found")),
                quality=summary.get("quality"),
                # What the job keeps once its input is dropped: its output and its run.
                disk_bytes=(written or 0) + _run_bytes(store.run_root, summary["run_key"]),
            )
        else:  # failed, or the child could not start (fatal)
            error = {**reply["error"], "message": short_message(self.runner.scrub(job_id, reply["error"]["message"]))}
            store.update(job_id, only_if=(IN_PROGRESS,), status=FAILED, completed_at=now, error=error)
            if reply["event"] == "fatal":
                self._reap()
        # Its process is done with it (idle, or gone): a DELETE from here on deletes it rather than waiting for it
        # to stop, whatever settling is left.
        self.current = None
        self.runner.settle(job_id)

    def _reap(self) -> int | None:
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout=TERMINATE_GRACE_S * 2)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            return self.process.wait()

    def _signal(self, sig: int) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, sig)  # the child leads its own process group
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        """SIGTERM now (Prefect records the flow run as crashed), SIGKILL after the grace period."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        self._signal(signal.SIGTERM)

        def kill_later() -> None:
            try:
                process.wait(timeout=TERMINATE_GRACE_S)
            except subprocess.TimeoutExpired:
                if self.process is process:
                    self._signal(signal.SIGKILL)

        threading.Thread(target=kill_later, daemon=True).start()


class JobRunner:
    """The queue and its worker slots (`workers` jobs run at once; default 1, so jobs run in order), and the janitor
    that deletes finished jobs `retention_s` after they finished, or sooner, oldest first, while finished jobs keep
    more than `finished_quota_bytes` on disk.

    A request being read holds one of the `max_queued` admission slots; one key holds at most `uploads_per_key` of
    them at once, and less while other keys send (`admission`), so keys whose uploads stall (until their deadline)
    never leave another key without a slot. And
    one key holds at most `queued_per_key` places of the queue, its waiting jobs and its requests being read
    together, so a key that submits many quick jobs never fills the queue for the others."""

    def __init__(
        self,
        store: JobStore,
        spec: ModelSpec,
        workers: int,
        max_queued: int,
        retention_s: float,
        uploads_per_key: int | None = None,
        finished_quota_bytes: int | None = None,
        queued_per_key: int | None = None,
        finished_per_key: int | None = None,
        memory_budget: int | None = None,
    ) -> None:
        self.store = store
        self.spec = spec
        self.max_queued = max_queued
        self.retention_s = retention_s
        self.uploads_per_key = uploads_per_key or max(1, max_queued // 2)
        self.queued_per_key = queued_per_key or max_queued
        self.finished_quota_bytes = finished_quota_bytes
        self.finished_per_key = finished_per_key
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.waiting: dict[str, str | None] = {}  # queued jobs no worker has taken yet, and their owners (store.lock)
        self._admitting: dict[str | None, int] = {}  # requests being read that will queue a job, by key
        # Deletions (a client's DELETE, the janitor's expiry) one at a time: two at once would race to remove the
        # same run's files, and the second must find the job gone (404), not half-removed.
        self._deleting = threading.RLock()
        self.stopping = threading.Event()
        self.slots = [WorkerSlot(self, i) for i in range(max(1, workers))]
        self.janitor = threading.Thread(target=self._janitor_loop, name="k6vsr-job-janitor", daemon=True)
        self.memory = MemoryLedger(memory_budget, server_bytes=own_rss()) if memory_budget is not None else None
        self.watch = threading.Thread(target=self._watch_loop, name="k6vsr-memory-watch", daemon=True)

    def start(self) -> list[str]:
        """Requeue the jobs a previous server left queued or running, oldest first, then start the workers."""
        self.store.recount_inputs()
        resumed = []
        for entry in self.store.entries():
            if entry.status in ACTIVE:
                self.store.update(entry.id, status=QUEUED)
                self.submit(entry.id, entry.owner)
                resumed.append(entry.id)
            else:
                self.store.drop_input(entry.id)
        for slot in self.slots:
            slot.thread.start()
        self.janitor.start()
        if self.memory is not None:
            self.watch.start()
        if resumed:
            log.info("resuming %d job(s): %s", len(resumed), ", ".join(resumed))
        return resumed

    @contextmanager
    def admission(self, owner: str | None = None) -> Iterator[None]:
        """Hold a place in the queue while a request of `owner` (a key's id, or a client address's; None: anyone)
        is read: `QueueFull` when `max_queued` jobs already wait, `UploadsBusy` or `KeyQueueFull` when the key
        already holds its share of the requests being read or of the queue.

        Its share of the requests being read is `uploads_per_key` at most, and less while other keys send: at most
        `max_queued // (senders + 1)`, the senders counting it, so that one more key always finds a slot free. Keys
        whose uploads stall (until their deadline) thus never take every slot, however many of them there are
        (short of more keys than slots)."""
        with self.store.lock:
            if len(self.waiting) + sum(self._admitting.values()) >= self.max_queued:
                raise QueueFull(self.max_queued)
            senders = len(self._admitting.keys() - {owner}) + 1
            share = min(self.uploads_per_key, max(1, self.max_queued // (senders + 1)))
            if owner is not None and self._admitting.get(owner, 0) >= share:
                raise UploadsBusy(share)
            held = self._admitting.get(owner, 0) + sum(1 for who in self.waiting.values() if who == owner)
            if owner is not None and held >= self.queued_per_key:
                raise KeyQueueFull(self.queued_per_key)
            self._admitting[owner] = self._admitting.get(owner, 0) + 1
        try:
            yield
        finally:
            with self.store.lock:
                self._admitting[owner] -= 1
                if not self._admitting[owner]:
                    del self._admitting[owner]

    def submit(self, job_id: str, owner: str | None) -> None:
        with self.store.lock:
            self.waiting[job_id] = owner
        self.queue.put(job_id)

    def cancel(self, job_id: str) -> dict[str, Any] | None:
        """Mark a queued or running job cancelled; a running one's child process is terminated (and its slot
        settles the job once the child is gone), a queued one's files and run are freed at once."""
        with self.store.lock:
            job = self.store.get(job_id)
            if job is None or job["status"] not in ACTIVE:
                return job
            job = self.store.update(job_id, status=CANCELLED, completed_at=int(time.time()))
            self.waiting.pop(job_id, None)
            slot = next((slot for slot in self.slots if slot.current == job_id), None)
        if slot is not None:
            slot.terminate()
        else:
            self.settle(job_id)
        return job

    def running(self, job_id: str) -> bool:
        return any(slot.current == job_id for slot in self.slots)

    def settle(self, job_id: str) -> None:
        """Free what a job that no longer runs does not need: a completed job keeps only its output; a failed or
        cancelled one keeps no file, and a cancelled one's run is reclaimed. As a deletion: one at a time with
        them."""
        with self._deleting:
            job = self.store.get(job_id)
            if job is None:
                return
            if job["status"] == COMPLETED:
                self.store.drop_input(job_id)
            else:
                self.store.discard_dir(job_id)
            if job["status"] == CANCELLED:
                self.reclaim_run(job["run_key"])
        if self.finished_per_key is not None or (job["status"] == COMPLETED and self.finished_quota_bytes is not None):
            self.expire()  # one more finished job: its key may be past its count, the outputs past their budget

    def delete(self, job_id: str) -> bool:
        """Delete a job that no worker runs: its run unless another job refers to it, its files, and its record last
        (so a job that is gone has nothing left). False when it was already gone."""
        with self._deleting:
            job = self.store.get(job_id)
            if job is None:
                return False
            self.reclaim_run(job["run_key"], leaving=job_id)
            self.store.remove(job_id)
            return True

    def reclaim_run(self, run_key: str, leaving: str | None = None) -> None:
        """Delete the run from the run store unless a job (other than `leaving`) that is not cancelled refers to it;
        as `k6vsr gc` does, never while a live run holds it."""
        from storage import collect_garbage

        with self.store.lock:
            if any(
                entry.run_key == run_key and entry.status != CANCELLED and entry.id != leaving
                for entry in self.store.entries()
            ):
                return
        collect_garbage(self.store.run_root, run_keys=(run_key,))

    def expire(self) -> list[str]:
        """Delete the finished jobs that finished `retention_s` ago or earlier, a key's oldest finished jobs past
        `finished_per_key` of them, then, oldest first, those that take the finished jobs past `finished_quota_bytes`
        on disk. The newest finished job is kept whatever its size: its client can still fetch it."""
        deadline = time.time() - self.retention_s
        finished = sorted(
            (entry for entry in self.store.entries() if entry.status in FINISHED and not self.running(entry.id)),
            key=lambda entry: (entry.completed_at or 0, entry.created_ns),
        )
        expired = [entry for entry in finished if (entry.completed_at or 0) <= deadline]
        kept = [entry for entry in finished if (entry.completed_at or 0) > deadline]
        if self.finished_per_key is not None:  # each key's oldest finished jobs past its count
            counts: dict[str | None, int] = {}
            for entry in kept:
                counts[entry.owner] = counts.get(entry.owner, 0) + 1
            over_count = {owner: count - self.finished_per_key for owner, count in counts.items()}
            still = []
            for entry in kept:  # oldest first
                if over_count[entry.owner] > 0:
                    over_count[entry.owner] -= 1
                    expired.append(entry)
                else:
                    still.append(entry)
            kept = still
        if self.finished_quota_bytes is not None:
            over = sum(entry.disk_bytes for entry in kept) - self.finished_quota_bytes
            for entry in kept[:-1]:
                if over <= 0:
                    break
                if entry.disk_bytes:
                    expired.append(entry)
                    over -= entry.disk_bytes
        for entry in expired:
            self.delete(entry.id)
        if expired:
            log.info("deleted %d finished job(s): past retention, a key's count or the disk budget", len(expired))
        return [entry.id for entry in expired]

    def _watch_loop(self) -> None:
        while not self.stopping.wait(MEMORY_WATCH_S):
            try:
                self.check_memory()
            except Exception:  # noqa: BLE001 - the next round measures again
                log.exception("could not measure the server's memory")

    def check_memory(self) -> None:
        """Measure the server and its worker processes; stop the largest job while together they pass the budget
        (it fails naming the budget), and note the size of idle workers for admission."""
        assert self.memory is not None
        self.memory.server_bytes = own_rss()
        sizes = self._worker_sizes()
        for slot, size in sizes.items():
            if slot.current is None:
                self.memory.idle_worker(size)
        total = self.memory.server_bytes + sum(sizes.values())
        running = [slot for slot in sizes if slot.current is not None and slot.over_memory is None]
        if total > self.memory.budget and running:
            largest = max(running, key=lambda slot: sizes[slot])
            largest.over_memory = (
                f"the job outgrew the server's memory budget: {total >> 20} MB with the server and its workers, "
                f"over {self.memory.budget >> 20} MB (--memory-budget-mb); lower sr_resolution_scale, set "
                "max_frames or send a smaller clip"
            )
            log.warning("job %s stopped: %s", largest.current, largest.over_memory)
            largest._signal(signal.SIGKILL)  # memory runs out faster than a graceful stop

    def _worker_sizes(self) -> dict[WorkerSlot, int]:
        return {slot: tree_rss(slot.process.pid) for slot in self.slots if slot._alive() and slot.process is not None}

    def _janitor_loop(self) -> None:
        interval = min(60.0, max(0.5, self.retention_s / 4))
        while not self.stopping.wait(interval):
            try:
                self.expire()
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("could not delete the expired jobs")

    def scrub(self, job_id: str, message: str) -> str:
        """A job's error message without the server's paths."""
        known = {
            str(self.store.input_path(job_id)): "the clip",
            str(self.store.output_path(job_id)): "the output",
            str(self.store.store_root): "<store>",
            str(self.store.store_root.resolve()): "<store>",
            str(self.store.run_root): "<store>",
        }
        return scrub_paths(message, known)

    def stop(self) -> None:
        """Stop taking jobs and stop the children; running jobs stay `in_progress` and resume on the next start."""
        self.stopping.set()
        for _ in self.slots:
            self.queue.put(None)
        for slot in self.slots:
            slot.terminate()
        for slot in self.slots:
            if slot.thread.is_alive():
                slot.thread.join(timeout=TERMINATE_GRACE_S * 3)
            if slot.process is not None and slot.process.poll() is None:
                slot._signal(signal.SIGKILL)
                # The child may be warming up with no job, so nobody else waits on it.
                slot.process.wait(timeout=TERMINATE_GRACE_S)
        if self.janitor.is_alive():
            self.janitor.join(timeout=TERMINATE_GRACE_S)
        # The children are gone: their flow runs are marked Crashed now, by this thread, before the server exits.
        # A slot thread does it too once its child is gone, but the process may end before that thread gets there.
        try:
            _mark_crashed_runs()
        except Exception:  # noqa: BLE001 - the next command that looks marks them
            log.warning("could not mark the stopped jobs' flow runs as crashed", exc_info=True)


def job_message(store: JobStore, job: dict[str, Any]) -> dict[str, Any]:
    """What a job's child is handed, and so all its flow run's parameters hold: the job's own files and the request
    (a few hundred bytes), never the plan; the flow plans the job's input again, as the server did at
    submit, and from ingest on runs the plan recorded in the run's manifest."""
    return {
        "id": job["id"],
        "source": str(store.input_path(job["id"])),  # the job's own copy: nothing a client can swap
        "output": str(store.output_path(job["id"])),
        "params": job["request"],
        "store_root": str(store.run_root),
        "latent_fps": job.get("latent_fps"),
    }


def tile_counts(summary: dict[str, Any], found: int | None) -> dict[str, int]:
    """A finished job's tiles: those its run held when the job first started were reused, the others computed.

    The flow's summary counts its own attempt only: after a restart it would call the tiles the killed attempt
    computed "reused". `found` (None: unknown) corrects that; a tile another job computed meanwhile on the same run
    counts as this job's."""
    total, computed = summary["tiles_total"], summary["tiles_computed"]
    if found is not None:
        computed = min(total, max(computed, total - found))
    return {"total": total, "computed": computed, "reused": total - computed}


def _tiles_decoded(store_root: str | Path, run_key: str) -> int:
    from storage import RunRef

    return RunRef(store_root=str(store_root), run_key=run_key).open().tiles_decoded()


@contextmanager
def results_beside(output: str) -> Iterator[None]:
    """Prefect persists a failed flow run's exception, pickled, with the server's paths in it: into the job's own
    folder (beside its `output`), deleted with the job, instead of PREFECT_HOME, where nothing ever deletes it."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    with temporary_settings(updates={PREFECT_LOCAL_STORAGE_PATH: Path(output).parent / "prefect-results"}):
        yield


def _run_bytes(store_root: str | Path, run_key: str) -> int:
    """Bytes of a run's folder in the run store on this disk (0 if it is gone, or in an object store: the disk
    budget is this machine's)."""
    from storage import RunRef
    from storage.run_store import run_size

    run = RunRef(store_root=str(store_root), run_key=run_key).open()
    if run.remote:
        return 0
    path = run.path
    return run_size(path) if path.is_dir() else 0


def _mark_crashed_runs() -> None:
    """A child killed outright left its flow run "Running": mark it Crashed now, not at the next command."""
    url = os.environ.get("PREFECT_API_URL")
    if url:
        from runtime.flow_leases import mark_crashed_runs

        mark_crashed_runs(url)


# ----------------------------------------------------------------------------------------------- the child


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(1)


def _error_of(err: BaseException) -> dict[str, str]:
    """A failed job's error, typed: the client's fault (its input or values) or the server's, one short line."""
    from k6vsr_core.errors import MediaError, ParameterError, describe_error

    message = describe_error(err)
    if message is None:
        return {"message": short_message(f"{type(err).__name__}: {err}"), "type": "server_error", "code": "job_failed"}
    code = "invalid_request"
    if isinstance(err, (MediaError, ParameterError)):
        code = "invalid_video" if isinstance(err, MediaError) else "invalid_value"
    return {"message": short_message(message), "type": "invalid_request_error", "code": code}


def _child_main(spec_json: str, parent_pid: int) -> int:
    """Run jobs read from stdin, one JSON line each; answer each with one JSON line on the original stdout."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever a library prints goes to stderr, never into the replies
    _die_with_parent(parent_pid)

    def reply(**event: Any) -> None:
        replies.write(json.dumps(event) + "\n")
        replies.flush()

    from entrypoints.console import CONSOLE_LEVEL_ENV, configure_terminal

    configure_terminal(verbose=os.environ.get(CONSOLE_LEVEL_ENV) == "INFO")  # as the server that started it
    try:
        from flows.upscale_clip import upscale_clip
        from k6vsr_core.params import UpscaleParams
        from runtime.runners import make_task_runner, warm_address
        from service.runs import ModelSpec, prepare_run
        from storage import RunRef

        spec = ModelSpec.model_validate_json(spec_json)
        # Load once, and every job of this process reuses it; with warm workers, they hold it, and this process
        # imports no torch. Should they stop later, a job's tiles run here and load it then.
        if warm_address() is None:
            from tasks.model_cache import get_bundle

            get_bundle(spec)
    except Exception as err:  # noqa: BLE001 - reported to the parent, which fails the job with it
        error = _error_of(err)
        error["message"] = f"the model could not be loaded: {error['message']}"
        for line in sys.stdin:
            reply(event="fatal", id=json.loads(line).get("id"), error=error)
            break
        return 1
    reply(event="ready")
    for line in sys.stdin:
        job = json.loads(line)
        try:
            with results_beside(job["output"]):
                # Planned again here, not carried from the request: a queued job may run after a restart, and
                # its record stays small (the plan is recorded once, in the run's manifest, by ingest).
                # The weights were checked where the model loaded (here at start, or on the warm workers).
                prepared = prepare_run(
                    job["source"],
                    UpscaleParams(**job["params"]),
                    spec,
                    job["store_root"],
                    job["latent_fps"],
                    tensors=False,
                )
                summary = upscale_clip.with_options(flow_run_name=job["id"], task_runner=make_task_runner())(
                    prepared=prepared, output=job["output"], model=spec
                )
            has_audio = RunRef(store_root=job["store_root"], run_key=summary.run_key).open().read_manifest().has_audio
            reply(event="done", id=job["id"], summary=summary.model_dump(mode="json"), has_audio=has_audio)
        except Exception as err:  # noqa: BLE001 - the job fails, the process serves the next one
            reply(event="failed", id=job["id"], error=_error_of(err))
        except BaseException:  # noqa: BLE001 - SIGTERM from a cancel: Prefect has recorded the crash; go now
            replies.flush()
            os._exit(143)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1], int(sys.argv[2])))
