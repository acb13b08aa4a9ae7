"""Jobs of the HTTP API: their records in the store, the queue, and the worker processes that run them.

A job is one run of the clip flow. Its record lives at `<store>/jobs/<id>.json` (written atomically) and its files
under `<store>/jobs/<id>/` (`input` for an upload, `output.mp4` once finished), so a server that was stopped or
killed finds its queued and running jobs again when it starts, and requeues them; since every job runs the resumable
clip flow, the tiles a killed run had finished are reused.

Each worker slot (`entrypoints.server.worker_slots`) owns one long-lived child process (`python -m
entrypoints.server.child`) that imports the pipeline and loads the model once, then runs jobs one at a time as the
parent hands them over a pipe (one JSON line each way). Cancelling a running job terminates that child: SIGTERM
first, so Prefect marks the flow run as crashed, then SIGKILL after a grace period. Every tile the run had finished
stays recorded in the run store. The slot then starts a fresh child. The child dies with its parent (Linux
`PR_SET_PDEATHSIG`, and EOF on its pipe elsewhere), so a killed server leaves no orphan computing on its own.

What jobs may hold is bounded: at most `max_queued` jobs wait (up to twice that while keys share them, see
`entrypoints.server.fair`); the inputs on disk (uploads, and the copies of path
sources) are charged to a quota as they are written and freed as soon as a job no longer needs them (once it ran,
or at once when it is cancelled); a cancelled or deleted job's run is reclaimed from the run store unless another
job still refers to it; and finished jobs are deleted `retention_s` after they finished, or sooner, oldest first,
while they keep more than their disk budget. A record holds the request and the run key, never the plan (the child
plans the job's own input again, once), so records, and what the child is handed, stay small.

Why not a deployment of the clip flow, run with `run_deployment` on a work pool whose concurrency is the slots: a
Prefect process worker starts a new process per flow run, which would load the model for every job, where a slot's
child loads it once; the per-key queue share, the upload slots, the input quota and the retention of finished
jobs are the HTTP API's own bounds, which a work pool does not have. Cancelling still ends in Prefect's terms: the
SIGTERM lets the flow run be marked crashed.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from entrypoints.server.confine import scrub_paths
from entrypoints.server.fair import FairQueue, FairShare, OverShare, PoolFull
from entrypoints.server.host_memory import MemoryLedger, own_rss, tree_rss
from entrypoints.server.job_records import (
    ACTIVE,
    CANCELLED,
    COMPLETED,
    FINISHED,
    QUEUED,
    JobRecord,
    JobStore,
    KeyQueueFull,
    QueueFull,
    UploadsBusy,
)
from entrypoints.server.worker_slots import TERMINATE_GRACE_S, SlotContext, WorkerSlot, _mark_crashed_runs

if TYPE_CHECKING:
    from entrypoints.server.config import Limits
    from service.runs import ModelSpec

log = logging.getLogger("k6vsr.server")

# How often the memory watch measures the server and its worker processes.
MEMORY_WATCH_S = 0.25
# How often the janitor tries the disk again while it is full.
DISK_RETRY_S = 1.0


class JobRunner:
    """The queue and its worker slots (`workers` jobs run at once; default 1), and the janitor that deletes finished
    jobs `retention_s` after they finished, or sooner, oldest first, while finished jobs keep more than
    `finished_quota_bytes` on disk.

    Keys (without keys: client addresses) share what they wait for (`entrypoints.server.fair`): the workers take
    jobs in turns across keys, so one key's backlog never holds back another key's job; the `max_queued` places of
    the queue (waiting jobs and requests being read) and the upload slots among them are shared by the keys that
    hold any, each key's share shrinking as more keys wait (`admission`), so a key that submits many quick jobs or
    whose uploads stall never leaves another key without its share. One key holds at most `uploads_per_key`
    uploads, and `queued_per_key` places, whatever its share."""

    def __init__(self, store: JobStore, spec: ModelSpec, workers: int, limits: Limits) -> None:
        self.store = store
        self.spec = spec
        self.max_queued = max_queued = limits.max_queued
        self.retention_s = limits.retention_s
        self.uploads_per_key = limits.uploads_per_key or max(1, max_queued // 2)
        self.places = FairShare(max_queued, cap=limits.queued_per_key)
        self.upload_slots = FairShare(max_queued, cap=self.uploads_per_key)
        self.finished_quota_bytes = limits.finished_quota_bytes
        self.finished_per_key = limits.finished_per_key
        memory_budget = limits.memory_budget_bytes
        self.queue = FairQueue()  # queued jobs no worker has taken yet, by owner
        self._admitting: dict[str | None, int] = {}  # requests being read that will queue a job, by key
        # Deletions (a client's DELETE, the janitor's expiry) one at a time: two at once would race to remove the
        # same run's files, and the second must find the job gone (404), not half-removed.
        self._deleting = threading.RLock()
        self.stopping = threading.Event()
        context = SlotContext(spec, store, self.queue, self.stopping, self.scrub, self.settle)
        self.slots = [WorkerSlot(context, i) for i in range(max(1, workers))]
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
        """Hold a place in the queue and an upload slot while a request of `owner` (a key's id, or a client
        address's) is read: `KeyQueueFull` or `UploadsBusy` when the key already holds its share of the queue
        (its waiting jobs and its requests being read) or of the upload slots, `QueueFull` when every place is
        taken within its holder's share.

        A share is `max_queued` divided by the keys that hold any (this one counted), and at most
        `queued_per_key` places or `uploads_per_key` uploads: a lone key may fill the queue, and a key arriving
        at a queue the others fill still gets its share (`FairShare`), the others taking no more until theirs
        are below theirs. Keys whose uploads stall are cut off by the body deadlines (`bodies`)."""
        with self.store.lock:
            places = self.queue.counts()
            for who, count in self._admitting.items():
                places[who] = places.get(who, 0) + count
            # Uploads first: a key whose places are all uploads still being sent is told so.
            try:
                self.upload_slots.check(self._admitting, owner)
            except OverShare as over:
                raise UploadsBusy(over.share, over.holders, over.capped) from None
            except PoolFull:
                raise QueueFull(self.max_queued) from None
            try:
                self.places.check(places, owner)
            except OverShare as over:
                raise KeyQueueFull(over.share, over.holders, over.capped) from None
            except PoolFull:
                raise QueueFull(self.max_queued) from None
            self._admitting[owner] = self._admitting.get(owner, 0) + 1
        try:
            yield
        finally:
            with self.store.lock:
                self._admitting[owner] -= 1
                if not self._admitting[owner]:
                    del self._admitting[owner]

    def submit(self, job_id: str, owner: str | None) -> None:
        """Queue a job of `owner`; the workers take it in its owner's turn (`FairQueue`)."""
        self.queue.put(job_id, owner)

    def cancel(self, job_id: str) -> JobRecord | None:
        """Mark a queued or running job cancelled; a running one's child process is terminated (and its slot
        settles the job once the child is gone), a queued one's files and run are freed at once."""
        with self.store.lock:
            job = self.store.get(job_id)
            if job is None or job.status not in ACTIVE:
                return job
            job = self.store.update(job_id, status=CANCELLED, completed_at=int(time.time()))
            self.queue.remove(job_id)
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
            if job.status == COMPLETED:
                self.store.drop_input(job_id)
            else:
                self.store.discard_dir(job_id)
            if job.status == CANCELLED:
                self.reclaim_run(job.run_key)
        if self.finished_per_key is not None or (job.status == COMPLETED and self.finished_quota_bytes is not None):
            self.expire()  # one more finished job: its key may be past its count, the outputs past their budget

    def delete(self, job_id: str) -> bool:
        """Delete a job that no worker runs: its run unless another job refers to it, its files, and its record last
        (so a job that is gone has nothing left). False when it was already gone."""
        with self._deleting:
            job = self.store.get(job_id)
            if job is None:
                return False
            self.reclaim_run(job.run_key, leaving=job_id)
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
        next_expiry = time.monotonic() + interval
        # Every second it looks at the disk: while it is full, the records kept in memory are written, and /health
        # stops saying so, soon after there is room again.
        while not self.stopping.wait(min(interval, DISK_RETRY_S)):
            try:
                if self.store.disk.full:
                    self.store.flush_unsaved()
                if time.monotonic() >= next_expiry:
                    next_expiry = time.monotonic() + interval
                    self.expire()
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("could not delete the expired jobs, or write the records kept in memory")

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
        self.queue.close()
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
