"""What stage tasks return: small descriptors, never tensors."""

from __future__ import annotations

from pydantic import BaseModel

from k6vsr_core.contract.plan import ClipPlan
from k6vsr_core.contract.stage_names import Stage


class StageResult(BaseModel):
    stage: Stage
    item: str = "all"
    computed: bool
    seconds: float = 0.0
    dit_calls: int = 0
    tiles: tuple[int, ...] = ()
    window: int = 0
    # Seconds before its task returned that this stage's work ended: a task that runs several stages reports each.
    ends_before: float = 0.0
    # A model stage's work: when it began (wall clock, `time.time()`, comparable across a host's processes), and the
    # spans inside it that compiled kernels or waited for another thread's compile (`flows.preview` leaves them out).
    started_at: float = 0.0
    compile_spans: list[tuple[float, float]] = []


class IngestResult(StageResult):
    plan: ClipPlan  # as recorded in the manifest: planned on the frames that were actually decoded
