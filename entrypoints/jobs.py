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
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The child process runs this module: it imports only the standard library at the top, so that it is bound to its
# parent before the pipeline's imports (seconds on a busy machine) run. The pipeline is imported where it is used.
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


def _write_record(path: Path, job: dict[str, Any]) -> None:
    from storage.records import atomic_write_json

    atomic_write_json(path, job)


def new_job_id() -> str:
    return ID_PREFIX + secrets.token_urlsafe(18)


def valid_job_id(job_id: str) -> bool:
    """Ids come from URLs: anything that is not one of ours never reaches the file system."""
    return bool(_ID.match(job_id))


class JobStore:
    """The job records of one store root. Every read-modify-write holds one lock, so the HTTP handlers and the
    worker threads never lose each other's updates (one server per store)."""

    def __init__(self, store_root: str | Path) -> None:
        self.store_root = Path(store_root)
        self.root = self.store_root / JOBS
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()

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
        return job

    def update(self, job_id: str, only_if: tuple[str, ...] | None = None, **changes: Any) -> dict[str, Any] | None:
        """Apply `changes` (when the status is in `only_if`, if given); returns the job as it is afterwards."""
        with self.lock:
            job = self.get(job_id)
            if job is None:
                return None
            if only_if is None or job["status"] in only_if:
                job.update(changes)
                _write_record(self.record_path(job_id), job)
            return job

    def all(self) -> list[dict[str, Any]]:
        jobs = []
        for path in self.root.glob(f"{ID_PREFIX}*.json"):
            job = self.get(path.stem)
            if job is not None:
                jobs.append(job)
        return sorted(jobs, key=lambda job: (job.get("created_ns", 0), job["id"]))

    def remove(self, job_id: str) -> None:
        """Delete the record and the job's own files (never the shared run store)."""
        with self.lock:
            shutil.rmtree(self.job_dir(job_id), ignore_errors=True)
            self.record_path(job_id).unlink(missing_ok=True)

    def discard_dir(self, job_id: str) -> None:
        shutil.rmtree(self.job_dir(job_id), ignore_errors=True)


# ----------------------------------------------------------------------------------------------- worker slots


class WorkerSlot:
    """One worker thread and its child process."""

    def __init__(self, runner: JobRunner, index: int) -> None:
        self.runner = runner
        self.index = index
        self.process: subprocess.Popen[str] | None = None
        self.current: str | None = None
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
                    job_id, only_if=ACTIVE, status=FAILED, completed_at=int(time.time()),
                    error={"message": "internal error in the job worker", "type": "server_error"},
                )
            finally:
                self.current = None

    def _run(self, job_id: str) -> None:
        store = self.runner.store
        with store.lock:
            job = store.get(job_id)
            if job is None or job["status"] != QUEUED:
                return  # cancelled or deleted while it waited
            self.current = job_id
            store.update(job_id, status=IN_PROGRESS, started_at=int(time.time()))
        if not self._alive():
            self._spawn()
        assert self.process is not None and self.process.stdin is not None and self.process.stdout is not None
        message = {
            "id": job_id,
            "source": job["source"]["path"],
            "output": str(store.output_path(job_id)),
            "params": job["request"],
            "store_root": str(store.store_root),
            "prepared": job.get("prepared"),
        }
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
        if reply is not None and reply["event"] == "done":
            summary = reply["summary"]
            width, height = summary["size"]
            output = store.output_path(job_id)
            store.update(
                job_id, only_if=(IN_PROGRESS,), status=COMPLETED, progress=100, completed_at=now,
                run_key=summary["run_key"],
                output={
                    "width": width, "height": height, "frames": summary["frames"], "fps": summary["fps"],
                    "has_audio": reply.get("has_audio"), "bytes": output.stat().st_size if output.is_file() else None,
                },
                tiles={
                    "total": summary["tiles_total"], "computed": summary["tiles_computed"],
                    "reused": summary["tiles_reused"],
                },
            )
            store.input_path(job_id).unlink(missing_ok=True)  # the run store holds what a rerun needs
            return
        if reply is not None:  # failed, or the child could not start (fatal)
            store.update(job_id, only_if=(IN_PROGRESS,), status=FAILED, completed_at=now, error=reply["error"])
            store.input_path(job_id).unlink(missing_ok=True)
            if reply["event"] == "fatal":
                self._reap()
            return
        # No reply: the child died under this job.
        code = self._reap()
        if self.runner.stopping.is_set():
            return  # stays in_progress: the next server start resumes it
        job = store.get(job_id)
        if job is not None and job["status"] == IN_PROGRESS:
            store.update(
                job_id, only_if=(IN_PROGRESS,), status=FAILED, completed_at=now,
                error={"message": f"the worker process exited (code {code}) during the job; resubmit the same "
                       "request to resume from its finished tiles", "type": "server_error"},
            )
        if not self.runner.stopping.is_set():
            self._spawn()  # warm up the next child while the queue is idle

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
    """The queue and its worker slots (`workers` jobs run at once; default 1, so jobs run in order)."""

    def __init__(self, store: JobStore, spec: ModelSpec, workers: int = 1) -> None:
        self.store = store
        self.spec = spec
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.stopping = threading.Event()
        self.slots = [WorkerSlot(self, i) for i in range(max(1, workers))]

    def start(self) -> list[str]:
        """Requeue the jobs a previous server left queued or running, oldest first, then start the workers."""
        resumed = []
        for job in self.store.all():
            if job["status"] in ACTIVE:
                self.store.update(job["id"], status=QUEUED)
                self.queue.put(job["id"])
                resumed.append(job["id"])
        for slot in self.slots:
            slot.thread.start()
        if resumed:
            log.info("resuming %d job(s): %s", len(resumed), ", ".join(resumed))
        return resumed

    def submit(self, job_id: str) -> None:
        self.queue.put(job_id)

    def cancel(self, job_id: str) -> dict[str, Any] | None:
        """Mark a queued or running job cancelled; a running one's child process is terminated."""
        job = self.store.update(
            job_id, only_if=ACTIVE, status=CANCELLED, completed_at=int(time.time()),
        )
        for slot in self.slots:
            if slot.current == job_id:
                slot.terminate()
        return job

    def running(self, job_id: str) -> bool:
        return any(slot.current == job_id for slot in self.slots)

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
    from k6vsr_core.errors import describe_error

    message = describe_error(err)
    if message is not None:
        return {"message": message, "type": "invalid_request_error"}
    return {"message": f"{type(err).__name__}: {err}", "type": "server_error"}


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
        from flows.runners import make_task_runner
        from flows.upscale_clip import upscale_clip
        from k6vsr_core.params import UpscaleParams
        from service.runs import ModelSpec, PreparedRun
        from storage import RunStore
        from tasks.model_cache import get_bundle

        spec = ModelSpec.model_validate_json(spec_json)
        get_bundle(spec)  # load once; every job of this process reuses it
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
            summary = upscale_clip.with_options(flow_run_name=job["id"], task_runner=make_task_runner())(
                source=job["source"],
                output=job["output"],
                params=UpscaleParams(**job["params"]),
                model=spec,
                store_root=job["store_root"],
                prepared=PreparedRun.model_validate(job["prepared"]) if job.get("prepared") else None,
            )
            has_audio = RunStore(job["store_root"], summary.run_key).read_manifest().has_audio
            reply(event="done", id=job["id"], summary=summary.model_dump(mode="json"), has_audio=has_audio)
        except Exception as err:  # noqa: BLE001 - the job fails, the process serves the next one
            reply(event="failed", id=job["id"], error=_error_of(err))
        except BaseException:  # noqa: BLE001 - SIGTERM from a cancel: Prefect has recorded the crash; go now
            replies.flush()
            os._exit(143)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1], int(sys.argv[2])))
