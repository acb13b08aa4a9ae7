"""The in-memory runner: every stage of one clip chained without any storage.

It is the reference the orchestrated pipeline must match byte for byte, and the simplest way to use the model from
Python. It computes window after window as the flow does, holding two windows' frames at most, and cannot resume.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from pydantic import BaseModel

from k6vsr_core import media
from k6vsr_core.contract import segments
from k6vsr_core.contract.latent import check_latent, fit_latent, plan_latent
from k6vsr_core.contract.params import UpscaleParams
from k6vsr_core.contract.plan import ClipPlan
from k6vsr_core.contract.source import SourceClip, read_source, read_window, source_audio
from k6vsr_core.contract.stage_names import Stage
from k6vsr_core.contract.windows import Window, segment_frames
from k6vsr_core.device.compute import ComputeProfile, apply_profile, default_profile
from k6vsr_core.device.memory_modes import MemoryMode
from k6vsr_core.model import stages
from k6vsr_core.model.bundle import ModelBundle, model_traits
from k6vsr_core.model.memory import apply_budget, budget_for
from k6vsr_core.model.pixels import TileBlender

T = TypeVar("T")


class UpscaleResult(BaseModel):
    model_config = {"arbitrary_types_allowed": True}

    output: str | None  # None when only frames were asked for
    plan: ClipPlan
    timings: dict[str, float]
    dit_calls: int
    # With `return_frames=True`: every output frame (T, H, W, 3) uint8 RGB, as handed to the encoder, and the audio as
    # the contract writes it (mono float32 at `audio_rate`, trimmed to the frames; None with `audio='none'`).
    frames: np.ndarray | None = None
    audio: np.ndarray | None = None
    audio_rate: int = media.AUDIO_SAMPLE_RATE


def upscale(
    source: str | Path | None,
    output: str | Path | None,
    bundle: ModelBundle,
    params: UpscaleParams | None = None,
    on_step: Callable[[int], None] | None = None,
    compute: ComputeProfile | None = None,
    return_frames: bool = False,
    latent: torch.Tensor | None = None,
    fps: float | Fraction | str | None = None,
    memory: MemoryMode = "auto",
) -> UpscaleResult:
    """Upscale `source` into the video file `output` with the loaded `bundle`, computing as `compute` (default) says.

    `return_frames=True` also returns the frames and the audio (all of them in memory: for short clips); `output`
    may then be None, and no file is written.

    `memory`: the GPU memory budget (`k6vsr_core.model.memory`) a bundle not yet placed under one is placed under,
    chosen
    as every other path chooses it for this clip on this card, so that the runner's KVAE chunks, and with them its
    bytes, are the command's and the workers'. A bundle already placed keeps its budget.

    `latent` (with `fps`, and `source=None`): an unscaled KVAE latent `[T, C, H, W]` instead of a video
    (`k6vsr_core.contract.latent`); scale 2 or 4; the output is silent unless `params.audio` is an audio file.
    """
    if output is None and not return_frames:
        raise ValueError("upscale needs an output file, or return_frames=True")
    params = params or UpscaleParams()
    if params.audio_file is not None:
        media.check_audio_file(params.audio_file)
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

    if latent is not None:
        if source is not None:
            raise ValueError("give a source video or a latent, not both")
        rate = check_latent(latent, int(bundle.vae.config.latent_channels), params, fps)
        plan = plan_latent(latent, rate, params, model_traits(bundle.info))
        scaled = fit_latent(stages.scale_latent(bundle, latent), plan)
        audio = None if params.audio_file is None else media.decode_audio(params.audio_file)
        clip = SourceClip(path="", frame_pts=None, rotation=0, plan=plan)
    elif source is None:
        raise ValueError("give a source video, or a latent and its fps")
    else:
        clip = read_source(source, params, model_traits(bundle.info))
        plan = clip.plan
        audio = source_audio(source, params)
    if return_frames and source is not None and audio is None and params.audio == "original":
        audio = media.decode_audio(source)  # the frames' caller gets the contract's track of the source
    if bundle.memory is None:
        apply_budget(bundle, budget_for(memory, bundle.device, plan))
    lap(Stage.INGEST)
    folder_of = None if output is None else Path(output).parent
    with tempfile.TemporaryDirectory(prefix=".k6vsr-segments-", dir=folder_of) as folder:
        finisher = _Finisher(plan, clip.rotation, audio, None if output is None else Path(folder), return_frames)
        with finisher:
            for window in plan.windows:
                if latent is not None:
                    encoded = scaled
                else:
                    encoded = stages.encode_clip(bundle, stages.prepare_window(read_window(clip, window), plan, window))
                lap(Stage.ENCODE)
                denoised: dict[int, torch.Tensor] = {}
                for chunk in plan.chunks:
                    lr_tiles = stages.cut_tiles(encoded, plan, chunk.tiles)
                    denoised.update(
                        zip(chunk.tiles, stages.denoise_chunk(bundle, lr_tiles, chunk, plan, count), strict=True)
                    )
                lap(Stage.DENOISE)
                finisher.start(window)
                for index in range(plan.num_tiles):
                    finisher.add(index, stages.decode_tile(bundle, denoised.pop(index), plan.depth))
                lap(Stage.DECODE)
                finisher.finish(window)
        if output is not None:
            segments.join_segments(
                finisher.segment_files, output, plan, audio, clip.rotation, None if source is None else str(source)
            )
    # The finisher's stages ran beside the model's: their busy seconds are its own; the wait for its last window
    # and the join are the mux's.
    for stage, seconds in finisher.timings.items():
        timings[stage] = timings.get(stage, 0.0) + seconds
    lap(Stage.MUX)
    result = UpscaleResult(output=None if output is None else str(output), plan=plan, timings=timings, dit_calls=calls)
    if return_frames:
        result.frames = np.concatenate(finisher.kept)
        result.audio = None if audio is None else np.asarray(media.trim_audio(audio, plan.num_frames, plan.clock))
    return result


class _Finisher:
    """Blends each window's tiles as they are decoded and writes its segment, on a thread of its own, while the
    model computes the next tiles and the next window: the bytes are those of doing it after them, the same
    operations in the same order (tiles added in tile order, windows one after another).

    At most one window waits to be finished while the next is computed: `start` waits for the window before the
    last, so no more than two windows' canvases are held.
    """

    def __init__(
        self, plan: ClipPlan, rotation: int, audio: np.ndarray | None, folder: Path | None, keep: bool
    ) -> None:
        self.plan, self.rotation, self.audio, self.folder, self.keep = plan, rotation, audio, folder, keep
        self.segment_files: list[str] = []
        self.kept: list[np.ndarray] = []
        self.timings: dict[str, float] = {}
        self._previous: np.ndarray | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k6vsr-finish")
        self._jobs: list[Future[object]] = []
        self._finished: list[Future[object]] = []
        self._blender: TileBlender | None = None

    def __enter__(self) -> _Finisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.shutdown(wait=True, cancel_futures=exc[0] is not None)
        if exc[0] is None:
            self._raise_failures()

    def start(self, window: Window) -> None:
        if len(self._finished) >= 2:
            self._finished[-2].result()
        self._raise_failures()
        self._blender = stages.window_blender(self.plan, window)

    def add(self, index: int, tile: torch.Tensor) -> None:
        if self._blender is None:
            raise RuntimeError("a tile was added before its window was started")
        self._submit(self._timed, Stage.BLEND, self._blender.add, index, tile)

    def finish(self, window: Window) -> None:
        blender, self._blender = self._blender, None
        self._finished.append(self._submit(self._write, blender, window))

    def _write(self, blender: TileBlender, window: Window) -> None:
        frames = self._timed(
            Stage.BLEND, lambda: stages.tensor_to_frames(stages.deliver(stages.blended(blender, window), self.plan))
        )
        self._timed(Stage.SEGMENT, self._segment, window, frames)

    def _segment(self, window: Window, frames: np.ndarray) -> None:
        joined = segment_frames(self.plan.windows, window.index, frames, self._previous)
        if self.keep:
            self.kept.append(joined)
        if self.folder is not None:
            segment = str(self.folder / f"{window.index:06d}.mp4")
            segments.write_segment(segment, joined, self.plan, self.audio, self.rotation, window.index)
            self.segment_files.append(segment)
        self._previous = frames

    def _timed(self, stage: str, fn: Callable[..., T], *args: object) -> T:
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.timings[stage] = self.timings.get(stage, 0.0) + time.perf_counter() - started

    def _submit(self, fn: Callable[..., object], *args: object) -> Future[object]:
        job = self._thread.submit(fn, *args)
        self._jobs.append(job)
        return job

    def _raise_failures(self) -> None:
        for job in self._jobs:
            if job.done():
                job.result()
        self._jobs = [job for job in self._jobs if not job.done()]
