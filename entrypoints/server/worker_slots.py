"""The HTTP API's worker slots: one worker thread and its child process each (`entrypoints.server.child`), which
runs the jobs its runner queues, one at a time, and records how each ended.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from entrypoints.server.disk import DISK_FULL_MESSAGE, is_disk_full
from entrypoints.server.fair import FairQueue
from entrypoints.server.job_records import (
    ACTIVE,
    CANCELLED,
    COMPLETED,
    FAILED,
    IN_PROGRESS,
    QUEUED,
    JobError,
    JobOutput,
    JobRecord,
    JobStore,
)
from entrypoints.server.messages import short_message

if TYPE_CHECKING:
    from service.runs import ModelSpec

log = logging.getLogger("k6vsr.server")

TERMINATE_GRACE_S = 3.0


@dataclass(frozen=True)
class SlotContext:
    """What a worker slot works with, handed over by its runner: the model its child loads, the job records, the
    queue it takes jobs from (in turns across keys), the server's stop, and how a finished job's message is
    scrubbed and its input and run settled."""

    spec: ModelSpec
    store: JobStore
    queue: FairQueue
    stopping: threading.Event
    scrub: Callable[[str, str], str]
    settle: Callable[[str], None]


class WorkerSlot:
    """One worker thread and its child process."""

    def __init__(self, context: SlotContext, index: int) -> None:
        self.context = context
        self.index = index
        self.process: subprocess.Popen[str] | None = None
        self.current: str | None = None
        self.over_memory: str | None = None  # set by the memory watch when it stops this job: the reason
        self.thread = threading.Thread(target=self._loop, name=f"k6vsr-job-worker-{index}", daemon=True)

    # The thread that starts a child must outlive it: PR_SET_PDEATHSIG fires when that *thread* exits. So only this
    # slot's own thread ever spawns.
    def _spawn(self) -> None:
        spec = self.context.spec.model_dump_json()
        command = [sys.executable, "-m", "entrypoints.server.child", spec, str(os.getpid())]
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
            job_id = self.context.queue.get()
            if job_id is None or self.context.stopping.is_set():
                return
            try:
                self._run(job_id)
            except Exception as err:  # noqa: BLE001 - one bad job must not take the worker down
                self._fail(job_id, err)
            finally:
                self.current = None

    def _fail(self, job_id: str, err: Exception) -> None:
        """Record that the worker itself failed under a job; whatever that costs, the worker takes the next one."""
        if is_disk_full(err):
            self.context.store.disk.hit()
            log.error("job %s failed: %s (%s)", job_id, DISK_FULL_MESSAGE, err)
            error = disk_full_error()
        else:
            log.exception("job %s: unexpected error in the worker", job_id, exc_info=err)
            error = JobError(message="internal error in the job worker", type="server_error", code="job_failed")
        try:
            self.context.store.update(job_id, only_if=ACTIVE, status=FAILED, completed_at=int(time.time()), error=error)
            self.current = None
            self.context.settle(job_id)
        except Exception:  # noqa: BLE001 - the record stays as it was: a restart resumes the job
            log.exception("job %s: its failure could not be recorded", job_id)

    def _run(self, job_id: str) -> None:
        store = self.context.store
        with store.lock:
            job = store.get(job_id)
            if job is None or job.status != QUEUED:
                return  # cancelled or deleted while it waited
            self.current = job_id
            found = job.tiles_found
            if found is None:  # a job resumed after a restart keeps the count of its first start
                found = _tiles_decoded(store.run_root, job.run_key)
            store.update(job_id, status=IN_PROGRESS, started_at=int(time.time()), tiles_found=found)
        log.info("job %s started on worker %d", job_id, self.index)
        if not self._alive():
            self._spawn()
        assert self.process is not None and self.process.stdin is not None and self.process.stdout is not None
        message = job_message(store, job)
        reply: dict[str, Any] | None = None
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
            latest = store.get(job_id)
            if latest is not None and latest.status == CANCELLED:
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
        store = self.context.store
        now = int(time.time())
        if reply is None:  # the child died under this job: cancelled, stopping, or crashed
            code = self._reap()
            _mark_crashed_runs()
            if self.context.stopping.is_set():
                return  # stays in_progress, input kept: the next server start resumes it
            error = JobError(
                message=f"the worker process exited (code {code}) during the job; resubmit the same "
                "request to resume from its finished tiles",
                type="server_error",
                code="worker_exited",
            )
            if self.over_memory is not None:
                error = JobError(message=self.over_memory, type="invalid_request_error", code="memory_exceeded")
                self.over_memory = None
            store.update(job_id, only_if=(IN_PROGRESS,), status=FAILED, completed_at=now, error=error)
            self._spawn()  # warm up the next child while the queue is idle
        elif reply["event"] == "done":
            summary = reply["summary"]
            width, height = summary["size"]
            output = store.output_path(job_id)
            written = output.stat().st_size if output.is_file() else None
            started = store.get(job_id)
            store.update(
                job_id,
                only_if=(IN_PROGRESS,),
                status=COMPLETED,
                progress=100,
                completed_at=now,
                run_key=summary["run_key"],
                output=JobOutput(
                    width=width,
                    height=height,
                    frames=summary["frames"],
                    fps=summary["fps"],
                    has_audio=reply.get("has_audio"),
                    bytes=written,
                ).with_pixels_of(started.output if started is not None else None),
                tiles=tile_counts(summary, started.tiles_found if started is not None else None),
                quality=summary.get("quality"),
                # What the job keeps once its input is dropped: its output and its run.
                disk_bytes=(written or 0) + _run_bytes(store.run_root, summary["run_key"]),
            )
        else:  # failed, or the child could not start (fatal)
            if reply["error"].get("code") == DISK_FULL_CODE:
                store.disk.hit()
            error = JobError.model_validate(
                {**reply["error"], "message": short_message(self.context.scrub(job_id, reply["error"]["message"]))}
            )
            store.update(job_id, only_if=(IN_PROGRESS,), status=FAILED, completed_at=now, error=error)
            if reply["event"] == "fatal":
                self._reap()
        # Its process is done with it (idle, or gone): a DELETE from here on deletes it rather than waiting for it
        # to stop, whatever settling is left.
        self.current = None
        self.context.settle(job_id)

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


DISK_FULL_CODE = "disk_full"


def disk_full_error() -> JobError:
    """How a job that found the server's disk full fails; the child's `_error_of` says the same."""
    return JobError(
        message=f"{DISK_FULL_MESSAGE}: the job could not write its files; resubmit the same request once there is "
        "room, to resume from its finished tiles",
        type="server_error",
        code=DISK_FULL_CODE,
    )


def job_message(store: JobStore, job: JobRecord) -> dict[str, Any]:
    """What a job's child is handed, and so all its flow run's parameters hold: the job's own files and the request
    (a few hundred bytes), never the plan; the flow plans the job's input again, as the server did at
    submit, and from ingest on runs the plan recorded in the run's manifest."""
    return {
        "id": job.id,
        "source": str(store.input_path(job.id)),  # the job's own copy: nothing a client can swap
        "output": str(store.output_path(job.id)),
        "params": job.request,
        "store_root": str(store.run_root),
        "latent_fps": job.latent_fps,
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
