"""The in-memory runner: every stage of one clip chained without any storage.

It is the reference the orchestrated pipeline must match byte for byte, and the simplest way to use the model from
Python. It keeps the whole clip in memory and cannot resume.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from k6vsr_core import media, stages
from k6vsr_core.bundle import ModelBundle, model_traits
from k6vsr_core.compute import ComputeProfile, apply_profile, default_profile
from k6vsr_core.params import UpscaleParams
from k6vsr_core.plan import ClipPlan, ModelTraits, make_plan


class Decoded(BaseModel):
    """A source read and planned: what the first stage hands on."""

    model_config = {"arbitrary_types_allowed": True}

    frames: np.ndarray
    audio: np.ndarray | None
    rotation: int  # display rotation of the source, carried to the output
    plan: ClipPlan


class UpscaleResult(BaseModel):
    output: str
    plan: ClipPlan
    timings: dict[str, float]
    dit_calls: int


def read_source(path: str | Path, params: UpscaleParams, traits: ModelTraits) -> Decoded:
    """Decode the kept frames and the audio of a source, and plan the clip on what was actually decoded."""
    probe = media.probe(path)
    frames, fps = media.decode_frames(path, probe)
    audio = media.decode_audio(path)
    plan = make_plan((frames.shape[1], frames.shape[2]), frames.shape[0], fps, params, traits)
    return Decoded(frames=frames, audio=audio, rotation=probe.rotation, plan=plan)


def upscale(
    source: str | Path,
    output: str | Path,
    bundle: ModelBundle,
    params: UpscaleParams | None = None,
    on_step: Callable[[int], None] | None = None,
    compute: ComputeProfile | None = None,
) -> UpscaleResult:
    """Upscale `source` into the MP4 `output` with the loaded `bundle`, computing as `compute` (default) says."""
    params = params or UpscaleParams()
    apply_profile(compute or default_profile())
    timings: dict[str, float] = {}
    calls = 0

    def count(step: int) -> None:
        nonlocal calls
        calls += 1
        if on_step is not None:
            on_step(step)

    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[stage] = timings.get(stage, 0.0) + now - clock
        clock = now

    decoded = read_source(source, params, model_traits(bundle.info))
    plan = decoded.plan
    lap("ingest")
    latent = stages.encode_clip(bundle, stages.prepare_source(decoded.frames, plan))
    lap("encode")
    denoised = {}
    for chunk in plan.chunks:
        result = stages.denoise_chunk(bundle, stages.cut_tiles(latent, plan, chunk.tiles), chunk, plan, count)
        denoised.update(zip(chunk.tiles, result, strict=True))
    lap("denoise")
    tiles = [(index, stages.decode_tile(bundle, denoised[index])) for index in range(plan.num_tiles)]
    lap("decode")
    video = stages.deliver(stages.blend(plan, tiles), plan)
    lap("blend")
    media.write_video(output, stages.tensor_to_frames(video), plan.fps, decoded.audio, decoded.rotation)
    lap("mux")
    return UpscaleResult(output=str(output), plan=plan, timings=timings, dit_calls=calls)
