"""The names of a run's stages, once: the store's records, the Prefect tasks, the timeline, the schedule and the
progress all speak of a stage by these (a `StrEnum`, so a name read back from a record or a JSON line is equal to
its member)."""

from __future__ import annotations

from enum import StrEnum


class Stage(StrEnum):
    INGEST = "ingest"
    ENCODE = "encode"
    DENOISE = "denoise"
    DECODE = "decode"
    BLEND = "blend"
    SEGMENT = "segment"
    MUX = "mux"
    PUBLISH = "publish"
    QUALITY = "quality"  # the output's quality report, after the run
    PREVIEW = "preview"  # a preview's measured rates (`k6vsr preview`), before the run


PIPELINE = (
    Stage.INGEST,
    Stage.ENCODE,
    Stage.DENOISE,
    Stage.DECODE,
    Stage.BLEND,
    Stage.SEGMENT,
    Stage.MUX,
    Stage.PUBLISH,
)  # the order a run's stages start in
MODEL_STAGES = (Stage.ENCODE, Stage.DENOISE, Stage.DECODE)  # the loaded model's, on its device
CPU_STAGES = (Stage.BLEND, Stage.SEGMENT)  # a window's after its model stages, on the CPU


class TaskKind(StrEnum):
    """A task of a clip run (its Prefect task's name): a stage, or a few of a window's stages as one task, since each
    task run costs the Prefect API the same few requests whatever it does (`runtime.schedule`)."""

    INGEST = "ingest"
    ENCODE = "encode"
    DENOISE = "denoise"
    DECODE = "decode"
    DENOISE_DECODE = "denoise-decode"  # a chunk's denoise and the decode of its tiles
    BLEND = "blend"  # a preview's window: its blend alone
    BLEND_SEGMENT = "blend-segment"  # a run's window: its blend, its segment and its part of the quality report
    MUX = "mux"
    PUBLISH = "publish"
    QUALITY = "quality"
