"""What each run shows in the Prefect UI: its own progress artifact and its report, attached to that very run.

Every artifact names the flow run it belongs to explicitly (and no task run). A clip run started inside another
run's task would otherwise file its artifacts under that task, and they would not show on the clip run's page.
Keys name the clip and its run: clips that share a run key (two copies of one file) keep separate artifacts.

Artifacts are best effort: a Prefect API that cannot take one logs a warning and never fails a run.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import hashlib
import io
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from uuid import UUID

import numpy as np
from PIL import Image

from flows.stage_clock import StageSpan
from k6vsr_core.contract.plan import ClipPlan
from k6vsr_core.contract.quality import Comparison, QualityReport
from runtime.runners import is_dask_runner, thread_count
from storage import RunStore
from storage.progress import (
    SEPARATOR,
    RunProgress,
    StageCount,
    clip_text,
    clips_text,
    polling,
    read_progress,
    stored_plan,
)

THUMB_WIDTH = 320
KEY_NAME_LIMIT = 40

T = TypeVar("T")


# ------------------------------------------------------------------------------------------------ keys


def slug(text: str, limit: int = KEY_NAME_LIMIT) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit].strip("-") or "clip"


def clip_key(kind: str, source: str, run_key: str) -> str:
    """`<kind>-<file name>-<hash of its absolute path>-<run key>`: one key per clip and run."""
    location = hashlib.sha1(str(Path(source).expanduser().resolve()).encode()).hexdigest()[:6]
    return f"{kind}-{slug(Path(source).name)}-{location}-{run_key[:8].lower()}"


def flow_run_url(flow_run_id: str | UUID) -> str:
    """The flow run's page in the UI (relative when the UI address is not configured)."""
    from prefect.utilities.urls import url_for

    return url_for("flow-run", obj_id=str(flow_run_id)) or f"/runs/flow-run/{flow_run_id}"


# ------------------------------------------------------------------------------------------------ API


def _logger() -> logging.Logger | logging.LoggerAdapter:
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


# A call that found the API unreachable costs the client's retries (about a minute): the UI's next updates are skipped
# for this long rather than each paying that again while the work goes on (or stops, when its runs need the API).
UNREACHABLE_PAUSE_S = 60.0
_unreachable_until: dict[str, float] = {}  # API URL -> time.monotonic() until which its UI is not written


def _best_effort(what: str, call: Callable[[], T]) -> T | None:
    from prefect.settings import get_current_settings

    api = str(get_current_settings().api.url)
    if time.monotonic() < _unreachable_until.get(api, 0.0):
        return None
    try:
        return call()
    except Exception as err:  # noqa: BLE001 - the UI is best effort; the run store is the record
        if _unreachable(err):
            _unreachable_until[api] = time.monotonic() + UNREACHABLE_PAUSE_S
            _logger().warning(
                "could not %s in the Prefect UI: %s; its updates pause for %.0f s", what, err, UNREACHABLE_PAUSE_S
            )
        else:
            _logger().warning("could not %s in the Prefect UI: %s", what, err)
        return None


def _unreachable(err: BaseException) -> bool:
    """Whether `err` comes of no answer from the API at all (refused, reset, timed out), after the client's retries."""
    from runtime.api_loss import transport_errors

    return next(transport_errors(err), None) is not None


# Written on the client rather than with prefect.artifacts: its `create_*_artifact` functions take the task and flow
# run from the calling context (prefect 3.9: no flow_run_id argument), which files a clip run's artifacts under the
# task it was started from (see above), and only progress artifacts can be updated in place there.
_CLIENTS: dict[tuple[int, str | None, str | None], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _client() -> Any:
    """One open client per process and API (its address and auth), shared by the threads that write artifacts: a
    client of its own per call cost 60 ms of setup (an SSL context, a connection) a request, about ten times a clip."""
    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings

    api = get_current_settings().api
    secrets = [value.get_secret_value() for value in (api.auth_string, api.key) if value is not None]
    key = (os.getpid(), api.url, "\n".join(secrets) or None)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = get_client(sync_client=True)
            client.__enter__()
            _CLIENTS[key] = client
    return client


def create(kind: str, key: str, data: Any, description: str, flow_run_id: str | UUID | None) -> UUID | None:
    """A new artifact of `flow_run_id` (and of no task run)."""
    from prefect.client.schemas.actions import ArtifactCreate

    def call() -> UUID:
        request = ArtifactCreate(type=kind, key=key, data=data, description=description, flow_run_id=flow_run_id)
        return _client().create_artifact(artifact=request).id

    return _best_effort(f"create the artifact {key}", call)


def update(artifact_id: UUID | None, data: Any, description: str) -> None:
    """Replace an artifact's data and description in place: the run keeps one artifact, always current."""
    from prefect.client.schemas.actions import ArtifactUpdate

    if artifact_id is None:
        return

    def call() -> None:
        _client().update_artifact(artifact_id=artifact_id, artifact=ArtifactUpdate(data=data, description=description))

    _best_effort("update an artifact", call)


def percent(done: int, total: int) -> float:
    """Exactly 100 once everything is done."""
    return 100.0 if done >= total else 100.0 * done / total


# ------------------------------------------------------------------------------------------------ clip runs


class TileProgress:
    """A clip run's progress artifact: its data the share of tiles decoded, its description what the terminal's bar
    says (`decode · window 2 of 3 · 7 of 18 tiles`), updated as tasks finish, at most once per `every_s`.

    Each update is a request to the Prefect API: sent at every stage's end, they were a sixth of a run's requests.
    So a state is sent at once only when `every_s` has passed since the last one; else it waits, and a timer sends
    the newest one when the interval is up (a run whose tasks are minutes long still shows each state within
    `every_s`). `finish` sends the final state at once. The interval counts from the run's start, and the artifact
    is made by the first state sent: a clip shorter than `every_s` makes one request, its end. The terminal reads
    its progress from the run store, not from here: it is not held back.
    """

    def __init__(
        self,
        source: str,
        run_key: str,
        flow_run_id: str | UUID | None,
        progress: RunProgress,
        every_s: float = 0.0,
    ) -> None:
        self._key, self._run = clip_key("tiles", source, run_key), flow_run_id
        self._id: UUID | None = None  # made by the first state sent
        self._shown: str | None = None
        self._every, self._sent = every_s, time.monotonic()
        self._made = self._sent_made = 0  # the states given so far, and the number of the last one sent
        self._pending: tuple[int, RunProgress] | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()  # the fields above
        self._sending = threading.Lock()  # one request at a time, in order
        self.update(progress)

    def update(self, progress: RunProgress) -> None:
        """The run's progress as the store says it now; what was last sent is not sent again."""
        with self._lock:
            self._made += 1
            wait = self._every - (time.monotonic() - self._sent)
            if wait > 0:
                self._pending = (self._made, progress)
                if self._timer is None:
                    # In the caller's context: Prefect's settings (which API, its auth) are context variables, and a
                    # thread of its own would see none of them (and start an API of its own).
                    self._timer = threading.Timer(wait, contextvars.copy_context().run, (self._send_pending,))
                    self._timer.daemon = True
                    self._timer.start()
                return
            self._pending = None
            made = self._made
        self._send(made, progress)

    def finish(self, progress: RunProgress) -> None:
        """The run's final state: sent at once, and nothing held back is sent after it."""
        with self._lock:
            self._made += 1
            made, self._pending = self._made, None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        self._send(made, progress)

    def _send_pending(self) -> None:
        with self._lock:
            pending, self._pending, self._timer = self._pending, None, None
        if pending is not None:
            self._send(*pending)

    def _send(self, made: int, progress: RunProgress) -> None:
        """Send the `made`-th state unless a later one is already out: the timer's thread and the flow's may both
        be sending, and the newest must be the one left shown."""
        text = progress.text()
        with self._sending:
            if made <= self._sent_made or text == self._shown:
                return
            self._shown, self._sent_made = text, made
            with self._lock:
                self._sent = time.monotonic()
            if self._id is None:
                self._id = create("progress", self._key, _share(progress), text, self._run)
            else:
                update(self._id, _share(progress), text)


def _share(progress: RunProgress) -> float:
    return percent(progress.decoded, progress.total)


@dataclass(frozen=True)
class ClipReport:
    """Everything the report of one clip run says, as plain values."""

    source: str
    run_key: str
    frames: int
    fps: int
    before: np.ndarray | None  # a source frame, (H, W, 3) uint8; None for a latent run: it has no frames
    after: np.ndarray  # the same frame of the output
    stages: list[StageSpan]
    run_seconds: float  # the run's clock when the report was made
    tiles_total: int
    tiles_computed: int
    tiles_reused: int
    items: dict[str, StageCount]  # per stage, in pipeline order: items computed and reused
    workers: str
    output: str  # absolute
    output_bytes: int
    store: str  # the run's folder in the run store
    reused_output: bool = False
    quality: QualityReport | None = None


def _thumbnail(frame: np.ndarray) -> str:
    image = Image.fromarray(frame)
    height = max(1, round(image.height * THUMB_WIDTH / image.width))
    buffer = io.BytesIO()
    image.resize((THUMB_WIDTH, height), Image.Resampling.BICUBIC).save(buffer, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    """A markdown table; `align` has one letter per column (`l`, `r`), left when missing."""

    def cell(value: Any) -> str:
        return " ".join(str("" if value is None else value).split()).replace("|", "\\|")

    marks = [{"r": "--:"}.get(align[i : i + 1], "---") for i in range(len(headers))]
    lines = [headers, marks, *rows]
    return "\n".join("| " + " | ".join(cell(value) for value in line) + " |" for line in lines)


def size_text(size: int) -> str:
    value, unit = float(size), "bytes"
    for larger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{size} bytes" if unit == "bytes" else f"{value:.1f} {unit}"


def _stills(report: ClipReport, after_size: str) -> str:
    """The before/after table, or the output's still alone when the input had no frames (a latent)."""
    after = f"![after]({_thumbnail(report.after)})"
    if report.before is None:
        return markdown_table([f"output ({after_size})"], [[after]])
    before_size = f"{report.before.shape[1]}x{report.before.shape[0]}"
    return markdown_table(
        [f"before ({before_size})", f"after ({after_size})"], [[f"![before]({_thumbnail(report.before)})", after]]
    )


def _ratio(comparison: Comparison | None) -> str:
    return "-" if comparison is None else f"{comparison.ratio:g}x ({comparison.at:g} / {comparison.inside:g})"


def quality_markdown(quality: QualityReport | None) -> list[str]:
    """The quality section: one row per measure, and what is past its limit."""
    if quality is None:
        return []
    rows = [
        ["flicker at window joins: difference energy", _ratio(quality.join_difference_energy), "joins / inside"],
        ["flicker at window joins: warping error (DIS flow)", _ratio(quality.join_warping_error), "joins / inside"],
        ["tile seams: step energy", _ratio(quality.tile_seam_energy), "borders / beside them"],
        ["tile seams of the bicubic source", _ratio(quality.tile_seam_energy_source), "borders / beside them"],
        [
            "colour drift (mean ΔE, CIELAB)",
            f"{quality.colour_drift_delta_e:g} (worst frame {quality.colour_drift_delta_e_max:g})",
            "against the bicubic-upscaled source",
        ],
        ["consistency with the source (PSNR)", f"{quality.source_psnr_db:g} dB", "output scaled down, against it"],
    ]
    verdict = "; ".join(quality.findings) if quality.findings else "no measure past its limit"
    return [
        "## Quality",
        markdown_table(["measure", "value", "compares"], rows, align="lrl"),
        f"{quality.joins} joins, {quality.tile_borders} tile borders, {quality.frames} frames, measured in "
        f"{quality.seconds:g} s on the CPU. **{verdict}.**",
    ]


def clip_report_markdown(report: ClipReport) -> str:
    after_size = f"{report.after.shape[1]}x{report.after.shape[0]}"
    before_size = "a latent" if report.before is None else f"{report.before.shape[1]}x{report.before.shape[0]}"
    frames = f"{report.frames} frame{'s' if report.frames != 1 else ''} at {report.fps} fps"
    stages = markdown_table(
        ["stage", "starts (s)", "ends (s)", "span (s)", "adds (s)", "tasks"],
        [
            *(
                [s.stage, f"{s.starts:.2f}", f"{s.ends:.2f}", f"{s.span:.2f}", f"{s.adds:.2f}", s.tasks]
                for s in report.stages
            ),
            ["run", "0.00", f"{report.run_seconds:.2f}", f"{report.run_seconds:.2f}", f"{report.run_seconds:.2f}", ""],
        ],
        align="lrrrrr",
    )
    reused = " (published from the finished run in the store)" if report.reused_output else ""
    return (
        "\n\n".join(
            [
                f"# {Path(report.source).name}",
                f"Run `{report.run_key}`: {frames}, {before_size} to {after_size}. Workers: {report.workers}.",
                _stills(report, after_size),
                "## Stages",
                stages,
                "Seconds on this run's clock, from its start. *span*: first start to last end of the stage's "
                "tasks; stages overlap (a tile decodes while the next chunk denoises), so spans may add up to more "
                "than the run. *adds*: from the end of the stage before to the end of this one, what the stage added "
                "to the run; these add up to the run's time until this report.",
                markdown_table(
                    ["tiles", "computed", "reused"],
                    [[report.tiles_total, report.tiles_computed, report.tiles_reused]],
                    align="rrr",
                ),
                "Items by stage, from the run's timeline: *computed* in this run, *reused* as an earlier run left "
                "them in the store.",
                markdown_table(
                    ["stage", "items", "computed", "reused"],
                    [[stage, c.computed + c.reused, c.computed, c.reused] for stage, c in report.items.items()],
                    align="lrrr",
                ),
                *quality_markdown(report.quality),
                f"**Output** `{report.output}` ({size_text(report.output_bytes)}){reused}",
                f"**Run store** `{report.store}`: the manifest, the stored stages and their completion records; "
                "rerunning the same command resumes from it.",
            ]
        )
        + "\n"
    )


def publish_clip_report(report: ClipReport, flow_run_id: str | UUID | None) -> UUID | None:
    description = (
        f"{report.tiles_computed} tiles computed, {report.tiles_reused} reused; "
        f"{report.run_seconds:.1f} s; {Path(report.output).name}"
    )
    return create(
        "markdown",
        clip_key("clip-report", report.source, report.run_key),
        clip_report_markdown(report),
        description,
        flow_run_id,
    )


def workers_in_use() -> str:
    """Where this flow run's tasks run: its Dask workers, or threads of this process."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    runner = context.task_runner if context is not None else None
    client = getattr(runner, "client", None) if is_dask_runner(runner) else None
    if client is not None:
        workers = client.scheduler_info(n_workers=-1)["workers"].values()
        hosts = sorted({str(worker.get("host", "?")) for worker in workers})
        return f"{len(workers)} Dask worker process{'es' if len(workers) != 1 else ''} on {', '.join(hosts)}"
    threads = thread_count(runner)  # the command's pool has two; Prefect's default, none set, has no bound
    count = f"{threads} threads" if threads else "a thread per task"
    return f"{count} in process {os.getpid()} on {socket.gethostname()}"


# ------------------------------------------------------------------------------------------------ archive runs


# Each change shown is a request to the Prefect API: at the GPU's pace (a window a minute) every 2 s cost up to 30 a
# window; every 10 s costs at most 6.
ARCHIVE_POLL_S = 10.0


class ArchiveProgress:
    """An archive run's progress artifact: clips done, failed and left, and where each running clip stands, read
    from its run store while it runs (`watching`): the words of the terminal's lines."""

    def __init__(self, archive: str, flow_run_id: str | UUID | None, total: int) -> None:
        self.total, self.done, self.failed = total, 0, 0
        self.running: dict[str, RunStore] = {}  # clip -> its run store, in the order they started
        self._plans: dict[str, ClipPlan] = {}
        self._lock = threading.Lock()  # clips start and end in several threads; each update shows one moment
        self._shown = self.text()
        self._id = create("progress", f"archive-progress-{archive}", 0.0, self._shown, flow_run_id)

    def started(self, clip: str, store: RunStore) -> None:
        """Shown by the next poll of `watching`, not at once: two requests a clip were a tenth of a short clip's."""
        with self._lock:
            self.running[clip] = store

    def finished(self, clip: str, failed: bool) -> None:
        with self._lock:
            del self.running[clip]
            self._plans.pop(clip, None)
            self.failed += failed
            self.done += not failed

    def text(self) -> str:
        """`clips: 1 done, 0 failed, 2 left · b.mp4: decode · window 2 of 3 · 7 of 18 tiles`."""
        clips = [clips_text(self.done, self.failed, self.total - self.done - self.failed)]
        for clip, store in self.running.items():
            plan = self._plans.get(clip) or stored_plan(store)
            if plan is not None:
                self._plans[clip] = plan
            clips.append(clip_text(clip, None if plan is None else read_progress(store, plan)))
        return SEPARATOR.join(clips)

    def _show(self) -> None:
        text = self.text()
        if text != self._shown:
            self._shown = text
            update(self._id, percent(self.done + self.failed, self.total), text)

    @contextlib.contextmanager
    def watching(self, every_s: float = ARCHIVE_POLL_S) -> Iterator[None]:
        """While the block runs, the clips and the running clips' progress are shown every `every_s` seconds as
        they change, and once more as it ends."""

        def show() -> None:
            with self._lock:
                self._show()

        try:
            with polling(show, "archive-progress", every_s):
                yield
        finally:
            show()
