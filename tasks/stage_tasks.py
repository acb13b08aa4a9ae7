"""One Prefect task per stage: read inputs from the run store, call `k6vsr_core`, write outputs, write the record.

Every task returns at once when its completion record is valid, is safe to run twice (and concurrently with a
twin: writes are per-chunk and records atomic), and retries transient errors. Completed work is recognised from
the store, not from Prefect's cache, whose default policy is per flow run and cannot see the data.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from k6vsr_core import media, stages
from k6vsr_core.compute import apply_profile
from k6vsr_core.errors import UserFacingError
from k6vsr_core.plan import ClipPlan
from service.runs import ModelSpec, RunRef
from storage import RunStore
from storage import publish as publish_file
from storage.manifest import library_versions
from tasks.descriptors import StageResult
from tasks.model_cache import get_bundle

# Errors that another attempt cannot fix (a MemoryBudgetError is a ValueError).
PERMANENT_ERRORS = (UserFacingError, ValueError)


def _retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    try:
        state.result()
    except PERMANENT_ERRORS:
        return False
    except Exception:  # noqa: BLE001 - anything else (CUDA, I/O hiccups) may pass on a retry
        return True
    return False


STAGE_TASK = dict(retries=2, retry_delay_seconds=1, retry_condition_fn=_retry_transient, cache_policy=NO_CACHE)


def _store(run: RunRef) -> RunStore:
    return RunStore(run.store_root, run.run_key)


def _plan(store: RunStore) -> ClipPlan:
    """The run's plan, with this process set to compute as the run's manifest says (see k6vsr_core.compute)."""
    manifest = store.read_manifest()
    apply_profile(manifest.compute)
    return manifest.plan


class MissingInput(RuntimeError):
    """A stage's input is not (or no longer) in the store; the flow reruns the stage that makes it."""


def _require(value: Any, run: RunRef, what: str) -> Any:
    if value is None:
        raise MissingInput(f"run {run.run_key}: {what} is missing or damaged")
    return value


@task(name="encode", task_run_name="encode-{run.run_key}", **STAGE_TASK)
def encode(run: RunRef, model: ModelSpec, attempt: str) -> StageResult:
    store = _store(run)
    if store.get("latent", stage="encode") is not None:
        return StageResult(stage="encode", computed=False)
    started = time.perf_counter()
    plan = _plan(store)
    frames = _require(store.get("frames", stage="ingest"), run, "the decoded source")
    latent = stages.encode_clip(get_bundle(model, plan), stages.prepare_source(frames, plan))
    seconds = time.perf_counter() - started
    store.put("latent", latent.numpy(), stage="encode", seconds=seconds, attempt=attempt)
    return StageResult(stage="encode", computed=True, seconds=seconds)


@task(name="denoise", task_run_name="denoise-chunk-{chunk_index}-tiles-{tiles_label}", **STAGE_TASK)
def denoise(run: RunRef, model: ModelSpec, chunk_index: int, attempt: str, tiles_label: str = "") -> StageResult:
    """Latent upscaler, seeded noise and DiT steps for one chunk of tiles (the seeding unit)."""
    store = _store(run)
    plan = _plan(store)
    chunk = plan.chunks[chunk_index]
    if all(store.tile_done("tile_latents", i, stage="denoise") for i in chunk.tiles):
        return StageResult(stage="denoise", item=str(chunk_index), computed=False, tiles=chunk.tiles)
    started = time.perf_counter()
    latent = _require(store.get("latent", stage="encode"), run, "the encoded latent")
    calls = 0

    def count(_: int) -> None:
        nonlocal calls
        calls += 1

    lr_tiles = stages.cut_tiles(torch.from_numpy(latent), plan, chunk.tiles)
    denoised = stages.denoise_chunk(get_bundle(model, plan), lr_tiles, chunk, plan, count)
    seconds = time.perf_counter() - started
    for index, tile in zip(chunk.tiles, denoised, strict=True):
        store.put_tile(
            "tile_latents", index, plan.num_tiles, tile.numpy(), stage="denoise", seconds=seconds, attempt=attempt
        )
    return StageResult(
        stage="denoise", item=str(chunk_index), computed=True, seconds=seconds, dit_calls=calls, tiles=chunk.tiles
    )


@task(name="decode", task_run_name="decode-tile-{tile}", **STAGE_TASK)
def decode(run: RunRef, model: ModelSpec, tile: int, attempt: str) -> StageResult:
    """KVAE decode of one tile to uint8 pixels; never recomputes the denoised latent it reads."""
    store = _store(run)
    plan = _plan(store)
    if store.tile_done("tiles", tile, stage="decode"):
        return StageResult(stage="decode", item=str(tile), computed=False, tiles=(tile,))
    started = time.perf_counter()
    latent = _require(store.get_tile("tile_latents", tile, stage="denoise"), run, f"the denoised latent of tile {tile}")
    pixels = stages.decode_tile(get_bundle(model, plan), torch.from_numpy(latent))
    seconds = time.perf_counter() - started
    store.put_tile("tiles", tile, plan.num_tiles, pixels.numpy(), stage="decode", seconds=seconds, attempt=attempt)
    return StageResult(stage="decode", item=str(tile), computed=True, seconds=seconds, tiles=(tile,))


@task(name="blend", task_run_name="blend-{run.run_key}", **STAGE_TASK)
def blend(run: RunRef, attempt: str) -> StageResult:
    """Hann-blend the stored tiles, crop, and downscale to the delivery tier."""
    store = _store(run)
    if store.get("video", stage="blend") is not None:
        return StageResult(stage="blend", computed=False)
    started = time.perf_counter()
    plan = _plan(store)
    tiles = []
    for index in range(plan.num_tiles):
        pixels = _require(store.get_tile("tiles", index, stage="decode"), run, f"decoded tile {index}")
        tiles.append((index, torch.from_numpy(pixels)))
    video = stages.deliver(stages.blend(plan, tiles), plan)
    seconds = time.perf_counter() - started
    store.put("video", stages.tensor_to_frames(video), stage="blend", seconds=seconds, attempt=attempt)
    return StageResult(stage="blend", computed=True, seconds=seconds)


@task(name="mux", task_run_name="mux-{run.run_key}", **STAGE_TASK)
def mux(run: RunRef, attempt: str) -> StageResult:
    """H.264 + AAC into the store's output file, written under a temporary name and renamed."""
    store = _store(run)
    if store.output_done():
        return StageResult(stage="mux", computed=False)
    started = time.perf_counter()
    manifest = store.read_manifest()
    apply_profile(manifest.compute)
    plan = manifest.plan
    video = _require(store.get("video", stage="blend"), run, "the blended video")
    audio = store.get("audio", stage="ingest", item="audio") if manifest.has_audio else None
    tmp = store.temp_output()
    try:
        media.write_video(tmp, video, plan.fps, audio, manifest.rotation)
        store.commit_output(tmp, time.perf_counter() - started, attempt)
    finally:
        tmp.unlink(missing_ok=True)
    return StageResult(stage="mux", computed=True, seconds=time.perf_counter() - started)


@task(name="publish", task_run_name="publish-{run.run_key}", **STAGE_TASK)
def publish(run: RunRef, destination: str) -> StageResult:
    """Copy the run's output to `destination` under a temporary name, then rename: no reader sees half a file."""
    started = time.perf_counter()
    publish_file(_store(run).output_path, Path(destination))
    return StageResult(stage="publish", computed=True, seconds=time.perf_counter() - started)


@task(name="workers-ready", cache_policy=NO_CACHE)
def workers_ready() -> dict[str, str]:
    """Runs on a worker: proves it can import and run k6vsr's tasks before any tile is sent to it."""
    return {"pid": str(os.getpid()), **library_versions()}
