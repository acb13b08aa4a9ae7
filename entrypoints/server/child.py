"""The job process of `k6vsr serve`: `python -m entrypoints.server.child SPEC PARENT_PID`, started by a worker
slot (`entrypoints.server.worker_slots`). It loads the model once, then runs the jobs handed over its stdin, one JSON
line each, and answers each with one JSON line. It dies with its parent.

It imports only the standard library at the top, so that it is bound to its parent before the pipeline's imports
(seconds on a busy machine) run; the pipeline is imported where it is used.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from entrypoints.server.messages import short_message


@contextmanager
def results_beside(output: str) -> Iterator[None]:
    """Prefect persists a failed flow run's exception, pickled, with the server's paths in it: into the job's own
    folder (beside its `output`), deleted with the job, instead of PREFECT_HOME, where nothing ever deletes it."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    with temporary_settings(updates={PREFECT_LOCAL_STORAGE_PATH: Path(output).parent / "prefect-results"}):
        yield


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
    from entrypoints.server.disk import is_disk_full
    from entrypoints.server.error_table import user_answer
    from entrypoints.server.worker_slots import disk_full_error
    from k6vsr_core.errors import UserFacingError, describe_error

    if is_disk_full(err):  # the server's disk, not the client's input
        return disk_full_error().model_dump(mode="json")
    message = describe_error(err)
    if message is None:
        return {"message": short_message(f"{type(err).__name__}: {err}"), "type": "server_error", "code": "job_failed"}
    code = user_answer(err)[1] if isinstance(err, UserFacingError) else "invalid_request"  # a file it named: OSError
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
        from flows.orchestrate import ClipRunContext, run_clip
        from k6vsr_core.contract.params import UpscaleParams
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
                # Its tiles here (the model is loaded) or on the warm workers; its flow run named after the job.
                ended = run_clip(prepared, job["output"], spec, make_task_runner(), ClipRunContext(name=job["id"]))
                summary = ended.summary()
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
