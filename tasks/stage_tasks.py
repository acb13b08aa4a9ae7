"""The stages as Prefect tasks: read inputs from the run store, call `k6vsr_core`, write outputs, write the record.

A stage writes its own records whichever task runs it; a run's window is fewer task runs than stages
(`denoise_decode`, `blend_segment`), since each task run costs the Prefect API the same few requests.

Every task returns at once when its completion record is valid, is safe to run twice (and concurrently with a
twin: writes are per-chunk and records atomic), and retries transient errors. Completed work is recognised from
the store, not from Prefect's cache, whose default policy is per flow run and cannot see the data.

torch, the stages and the model cache are imported by the task bodies, where they compute: the flows import this
module to submit its tasks, and a command, the HTTP server or a worker launcher must not pay seconds for torch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import av
import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE, CachePolicy

from k6vsr_core import media, settings
from k6vsr_core.contract import segments
from k6vsr_core.contract.latent import fit_latent, read_latent
from k6vsr_core.contract.plan import ClipPlan
from k6vsr_core.contract.stage_names import Stage, TaskKind
from k6vsr_core.contract.windows import segment_frames, shares_frames
from k6vsr_core.device.compute import apply_profile
from k6vsr_core.errors import MissingInput, ParameterError, UserFacingError, WindowStopped
from k6vsr_core.model import networks
from service.runs import ModelSpec, RunRef
from storage import RunManifest, RunStore, source_info
from storage import publish as publish_file
from storage.manifest import library_versions
from storage.urls import is_url, publish_to_url
from tasks.descriptors import StageResult

if TYPE_CHECKING:
    import torch

    from k6vsr_core.model.bundle import ModelBundle

# Errors that another attempt cannot fix: the user's (a MemoryBudgetError is one), and a window the flow stopped.
# Anything else, a broken invariant (a ValueError) included, may be a fault of this attempt (a damaged stored chunk,
# a worker's memory) and is retried.
PERMANENT_ERRORS = (UserFacingError, WindowStopped)


def _retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    try:
        state.result()
    except PERMANENT_ERRORS:
        return False
    except av.error.FFmpegError as err:
        # The decoder's verdict on the same bytes (end of file, bad data) is the same next time; only the system's
        # I/O errors (an OSError) may pass on a retry.
        return isinstance(err, OSError)
    except Exception:  # noqa: BLE001 - anything else (CUDA, I/O hiccups) may pass on a retry
        return True
    return False


class _TaskOptions(TypedDict):
    retries: int
    retry_delay_seconds: float
    retry_condition_fn: Callable[[Any, Any, Any], bool]
    cache_policy: CachePolicy


STAGE_TASK = _TaskOptions(retries=2, retry_delay_seconds=1, retry_condition_fn=_retry_transient, cache_policy=NO_CACHE)


def _store(run: RunRef) -> RunStore:
    return run.open()


def _plan(store: RunStore) -> ClipPlan:
    """The run's plan, with this process set to compute as the run's manifest says (see k6vsr_core.device.compute)."""
    manifest = store.read_manifest()
    apply_profile(manifest.compute)
    return manifest.plan


def _bundle(model: ModelSpec, plan: ClipPlan) -> ModelBundle:
    """This process's loaded model (`tasks.model_cache`)."""
    from tasks.model_cache import get_bundle

    return get_bundle(model, plan)


def _require(value: Any, run: RunRef, what: str) -> Any:
    if value is None:
        raise MissingInput(f"run {run.run_key}: {what} is missing or damaged")
    return value


def _array(plan: ClipPlan, name: str, window: int) -> str:
    """The stored array that holds `name` for `window`. A Zarr array's parts share one shape, and scene windows
    differ in length: each length then has its own array (`video-49`); even windows, and scene windows of a clip
    without cuts (which are the even ones), keep the one array."""
    if plan.params.windows == "even" or not plan.cuts:
        return name
    span = plan.windows[window]
    return f"{name}-{span.frames if name == 'video' else span.padded}"


def _arrays(plan: ClipPlan, names: tuple[str, ...], window: int) -> tuple[str, ...]:
    return tuple(_array(plan, name, window) for name in names)


def _window_finished(store: RunStore, plan: ClipPlan, window: int) -> bool:
    """Its segment and the next one are written: nothing will read the window's frames again."""
    following = [window + 1] if window + 1 < plan.num_windows else []
    return all(store.segment_done(w) for w in (window, *following))


def blended_frames(store: RunStore, plan: ClipPlan, window: int) -> np.ndarray | None:
    """The window's blended, delivered frames, while the store holds them (until its segments are written)."""
    return store.get_tile(_array(plan, "video", window), (window,), stage=Stage.BLEND)


def window_blended(store: RunStore, plan: ClipPlan, window: int) -> bool:
    """The window's frames are stored (or no longer needed): its tiles and latents are not needed either."""
    return store.tile_done(_array(plan, "video", window), (window,), stage=Stage.BLEND) or _window_finished(
        store, plan, window
    )


# Deleted as soon as the window is blended; its frames once the segments that read them are written.
WINDOW_INTERMEDIATES = ("latent", "tile_latents", "tiles")


@task(name=TaskKind.ENCODE, task_run_name="encode-window-{window}", **STAGE_TASK)
def encode(run: RunRef, model: ModelSpec, window: int, attempt: str) -> StageResult:
    """KVAE encode of one window's frames, read from the source."""
    from k6vsr_core.model import stages

    store = _store(run)
    plan = _plan(store)
    if window_blended(store, plan, window) or store.tile_done(
        _array(plan, "latent", window), (window,), stage=Stage.ENCODE
    ):
        return StageResult(stage=Stage.ENCODE, item=str(window), computed=False, window=window)
    started, started_at = time.perf_counter(), time.time()
    manifest = store.read_manifest()
    with _compile_spans() as compiling:
        if manifest.latent_fps is not None:
            latent = _given_latent(_bundle(model, plan), manifest, store.source_file(manifest))
        else:
            pts = _require(store.get("frame_pts", stage=Stage.INGEST), run, "the source's frame index")
            span = plan.windows[window]
            # From the store's copy in an object store: a worker on another host cannot see the client's disk.
            frames = media.read_frames(
                store.source_file(manifest),
                plan.source_indices(span),
                pts if len(pts) else None,
                plan.deinterlace,
                plan.depth,
            )
            latent = networks.current().encode_clip(_bundle(model, plan), stages.prepare_window(frames, plan, span))
    seconds = time.perf_counter() - started
    store.put_tile(
        _array(plan, "latent", window),
        (window,),
        (plan.num_windows,),
        latent.numpy(),
        stage=Stage.ENCODE,
        seconds=seconds,
        attempt=attempt,
    )
    return _computed(Stage.ENCODE, str(window), window, seconds, started_at, compiling)


def _computed(
    stage: Stage,
    item: str,
    window: int,
    seconds: float,
    started_at: float,
    compiling: list[tuple[float, float]],
    tiles: tuple[int, ...] = (),
    dit_calls: int = 0,
) -> StageResult:
    """What a model stage that computed its item returns: its seconds, when it began and when it compiled."""
    return StageResult(
        stage=stage,
        item=item,
        computed=True,
        seconds=seconds,
        dit_calls=dit_calls,
        tiles=tiles,
        window=window,
        started_at=started_at,
        compile_spans=compiling,
    )


@contextmanager
def _compile_spans() -> Iterator[list[tuple[float, float]]]:
    """The spans in which the block compiled kernels (`k6vsr_core.device.compile_cache.compile_spans`), imported where a
    model stage computes."""
    from k6vsr_core.device.compile_cache import compile_spans

    with compile_spans() as spans:
        yield spans


def _given_latent(bundle: ModelBundle, manifest: RunManifest, path: Path) -> torch.Tensor:
    """A latent run's one window: the latent file, scaled and padded onto the tile grid as the video's encode would
    leave it. A file changed since ingest is refused: the run and its key are of the content ingest planned."""
    from k6vsr_core.model import stages

    if source_info(path).sha256 != manifest.source.sha256:
        raise ParameterError(f"latent={manifest.source.path!r} changed since the run was planned; start it again")
    latent, _ = read_latent(path, int(bundle.vae.config.latent_channels), manifest.params, manifest.latent_fps)
    return fit_latent(stages.scale_latent(bundle, latent), manifest.plan)


@task(name=TaskKind.DENOISE, task_run_name="denoise-window-{window}-tiles-{tiles_label}", **STAGE_TASK)
def denoise(
    run: RunRef, model: ModelSpec, window: int, chunk_index: int, attempt: str, tiles_label: str = ""
) -> StageResult:
    """Latent upscaler, seeded noise and DiT steps for one chunk of tiles (the seeding unit) of one window."""
    import torch

    from k6vsr_core.model import stages

    store = _store(run)
    plan = _plan(store)
    chunk = plan.chunks[chunk_index]
    counts = (plan.num_windows, plan.num_tiles)
    done = window_blended(store, plan, window) or all(
        store.tile_done(_array(plan, "tile_latents", window), (window, i), stage=Stage.DENOISE) for i in chunk.tiles
    )
    if done:
        return StageResult(stage=Stage.DENOISE, item=str(chunk_index), computed=False, tiles=chunk.tiles, window=window)
    started, started_at = time.perf_counter(), time.time()
    latent = _require(
        store.get_tile(_array(plan, "latent", window), (window,), stage=Stage.ENCODE),
        run,
        f"the latent of window {window}",
    )
    calls = 0

    def count(_: int) -> None:
        nonlocal calls
        calls += 1

    lr_tiles = stages.cut_tiles(torch.from_numpy(latent), plan, chunk.tiles)
    with _compile_spans() as compiling:
        denoised = networks.current().denoise_chunk(_bundle(model, plan), lr_tiles, chunk, plan, count)
    seconds = time.perf_counter() - started
    for index, tile in zip(chunk.tiles, denoised, strict=True):
        store.put_tile(
            _array(plan, "tile_latents", window),
            (window, index),
            counts,
            tile.numpy(),
            stage=Stage.DENOISE,
            seconds=seconds,
            attempt=attempt,
        )
    return _computed(Stage.DENOISE, str(chunk_index), window, seconds, started_at, compiling, chunk.tiles, calls)


@task(name=TaskKind.DECODE, task_run_name="decode-window-{window}-tile-{tile}", **STAGE_TASK)
def decode(run: RunRef, model: ModelSpec, window: int, tile: int, attempt: str) -> StageResult:
    """KVAE decode of one tile of one window to pixels (`ClipPlan.depth`); never recomputes the denoised latent it
    reads."""
    import torch

    store = _store(run)
    plan = _plan(store)
    key = (window, tile)
    if window_blended(store, plan, window) or store.tile_done(_array(plan, "tiles", window), key, stage=Stage.DECODE):
        return StageResult(stage=Stage.DECODE, item=str(tile), computed=False, tiles=(tile,), window=window)
    started, started_at = time.perf_counter(), time.time()
    latent = _require(
        store.get_tile(_array(plan, "tile_latents", window), key, stage=Stage.DENOISE),
        run,
        f"the denoised latent of window {window} tile {tile}",
    )
    with _compile_spans() as compiling:
        pixels = networks.current().decode_tile(_bundle(model, plan), torch.from_numpy(latent), depth=plan.depth)
    seconds = time.perf_counter() - started
    counts = (plan.num_windows, plan.num_tiles)
    store.put_tile(
        _array(plan, "tiles", window), key, counts, pixels.numpy(), stage=Stage.DECODE, seconds=seconds, attempt=attempt
    )
    return _computed(Stage.DECODE, str(tile), window, seconds, started_at, compiling, (tile,))


@task(name=TaskKind.DENOISE_DECODE, task_run_name="denoise-decode-window-{window}-tiles-{tiles_label}", **STAGE_TASK)
def denoise_decode(
    run: RunRef, model: ModelSpec, window: int, chunk_index: int, attempt: str, tiles_label: str = ""
) -> list[StageResult]:
    """One chunk of a window denoised (`denoise`), then each of its tiles decoded (`decode`), as one task run: the
    order the model lane takes them in as separate tasks, without a task run each (each costs the Prefect API 3 to 4
    state events). Each stage still records each tile, so a retry or a resumed run decodes only the tiles not
    recorded, and denoises nothing whose latents are kept. Each result says how long before the task's end its
    stage ended (`ends_before`)."""
    results = [denoise.fn(run, model, window, chunk_index, attempt, tiles_label)]
    ended = [time.perf_counter()]
    for tile in results[0].tiles:
        results.append(decode.fn(run, model, window, tile, attempt))
        ended.append(time.perf_counter())
    return _ending(results, ended)


def _ending(results: list[StageResult], ended: list[float]) -> list[StageResult]:
    """`results` of a task that ran several stages, each with how long before the last one it ended."""
    return [
        result.model_copy(update={"ends_before": ended[-1] - at}) for result, at in zip(results, ended, strict=True)
    ]


@task(name=TaskKind.BLEND, task_run_name="blend-window-{window}", **STAGE_TASK)
def blend(run: RunRef, window: int, attempt: str) -> StageResult:
    """Hann-blend one window's tiles as they are decoded, crop, and downscale to the delivery tier; then drop its
    tiles.

    It starts with the window's first decoded tile and adds each next one, in tile order (the bytes of adding them
    all at the end), as soon as its decode is recorded: what is left after the window's last decode is one tile and
    the division. Its timeline line spans the wait; its busy seconds do not.
    """
    import torch

    from k6vsr_core.model import stages

    store = _store(run)
    plan = _plan(store)
    if window_blended(store, plan, window):
        store.drop_window(_arrays(plan, WINDOW_INTERMEDIATES, window), window)
        return StageResult(stage=Stage.BLEND, item=str(window), computed=False, window=window)
    started = time.perf_counter()
    span = plan.windows[window]
    blender = stages.window_blender(plan, span)
    waited = 0.0
    for index in range(plan.num_tiles):
        waited += _wait_for_decode(store, run, window, index, attempt)
        pixels = _require(
            store.get_tile(_array(plan, "tiles", window), (window, index), stage=Stage.DECODE),
            run,
            f"decoded tile {index} of window {window}",
        )
        blender.add(index, torch.from_numpy(pixels))
        del pixels
    video = stages.tensor_to_frames(stages.deliver(stages.blended(blender, span), plan))
    del blender
    seconds = time.perf_counter() - started
    store.put_tile(
        _array(plan, "video", window),
        (window,),
        (plan.num_windows,),
        video,
        stage=Stage.BLEND,
        seconds=seconds,
        attempt=attempt,
    )
    store.drop_window(_arrays(plan, WINDOW_INTERMEDIATES, window), window)
    return StageResult(stage=Stage.BLEND, item=str(window), computed=True, seconds=seconds - waited, window=window)


POLL_S = (0.02, 0.5)  # the first and the longest pause between two looks at the tile's record


def _wait_for_decode(store: RunStore, run: RunRef, window: int, tile: int, attempt: str) -> float:
    """Seconds spent waiting until tile `tile` of `window` is recorded decoded; raises once the flow says it will
    not be (`RunStore.stop_window`) or after `K6VSR_BLEND_WAIT` without it: a killed command's blend on a warm
    worker must not wait for ever (a decode takes seconds on a GPU; a full-size tile on a CPU, many minutes)."""
    wait_s = settings.read(settings.Store).blend_wait
    started = time.monotonic()
    pause = POLL_S[0]
    while not store.tile_recorded(Stage.DECODE, (window, tile)):
        if store.window_stopped(window, attempt):
            raise WindowStopped(f"run {run.run_key}: window {window} stopped before tile {tile} was decoded")
        if time.monotonic() - started > wait_s:
            raise MissingInput(
                f"run {run.run_key}: tile {tile} of window {window} was not decoded within {wait_s:g} s "
                "(K6VSR_BLEND_WAIT sets the wait)"
            )
        time.sleep(pause)
        pause = min(pause * 1.5, POLL_S[1])
    return time.monotonic() - started


def segment(run: RunRef, window: int, attempt: str) -> StageResult:
    """Cross-fade a window with the one before and encode its segment; then drop the frames no one needs. Not a task
    of its own: the second step of `blend_segment`."""
    store = _store(run)
    manifest = store.read_manifest()
    apply_profile(manifest.compute)
    plan = manifest.plan
    if store.segment_done(window) or store.output_done():
        return StageResult(stage=Stage.SEGMENT, item=str(window), computed=False, window=window)
    started = time.perf_counter()
    current = _require(
        store.get_tile(_array(plan, "video", window), (window,), stage=Stage.BLEND),
        run,
        f"the frames of window {window}",
    )
    previous = None
    if shares_frames(plan.windows, window):  # across a scene cut, nothing is cross-faded
        previous = _require(
            store.get_tile(_array(plan, "video", window - 1), (window - 1,), stage=Stage.BLEND),
            run,
            f"the frames of window {window - 1}",
        )
    frames = segment_frames(plan.windows, window, current, previous)
    del current, previous
    tmp = store.temp_file(store.segment_path(window), ".mp4")
    try:
        with _audio(store, run, plan.num_windows == 1 and manifest.has_audio) as audio:
            segments.write_segment(tmp, frames, plan, audio, manifest.rotation, window)
        store.commit_file(
            tmp, store.segment_path(window), Stage.SEGMENT, str(window), time.perf_counter() - started, attempt
        )
    finally:
        tmp.unlink(missing_ok=True)
    for finished in (window - 1, window):
        if finished >= 0 and _window_finished(store, plan, finished):
            store.drop_window((_array(plan, "video", finished),), finished)
    return StageResult(
        stage=Stage.SEGMENT, item=str(window), computed=True, seconds=time.perf_counter() - started, window=window
    )


@task(name=TaskKind.BLEND_SEGMENT, task_run_name="blend-segment-window-{window}", **STAGE_TASK)
def blend_segment(run: RunRef, window: int, attempt: str) -> list[StageResult]:
    """A window's CPU work as one task run: its blend (`blend`, which waits for the window's tiles), its segment
    (`segment`), then its part of the quality report (`tasks.quality.measure_window`, which never fails).

    One task run, not three: each costs the Prefect API 3 to 4 state events whatever it does. Each stage still
    writes its own record and finds it again, so a retry or a resumed run redoes only the stages not recorded. Each
    result says how long before the task's end its stage ended (`ends_before`), so the run's stage clock places it
    where it ran, not at the task's end.
    """
    from tasks.quality import measure_window

    results: list[StageResult] = []
    ended: list[float] = []
    for step in (blend.fn, segment, measure_window):
        results.append(step(run, window, attempt))
        ended.append(time.perf_counter())
    return _ending(results, ended)


@contextmanager
def _audio(store: RunStore, run: RunRef, wanted: bool) -> Iterator[np.ndarray | None]:
    """The stored audio if `wanted`, mapped rather than read: the muxer takes a segment's span at a time. From an
    object store it is mapped from a private download, kept while the block runs."""
    if not wanted:
        yield None
        return
    if not store.file_done(store.audio_path, Stage.INGEST, "audio"):
        raise MissingInput(f"run {run.run_key}: the audio is missing or damaged")
    with store.audio_path.fetch() as path:
        yield np.memmap(path, dtype=np.float32, mode="r")


@task(name=TaskKind.MUX, task_run_name="mux-{run.run_key}", **STAGE_TASK)
def mux(run: RunRef, attempt: str) -> StageResult:
    """Join the segments by stream copy, with the audio, into the store's output (temporary name, then rename). No
    tensor is computed: it runs in the flow's own process, which imports no torch when warm workers compute."""
    store = _store(run)
    if store.output_done():
        return StageResult(stage=Stage.MUX, computed=False)
    started = time.perf_counter()
    manifest = store.read_manifest()
    plan = manifest.plan
    for window in range(plan.num_windows):
        if not store.segment_done(window):
            raise MissingInput(f"run {run.run_key}: the segment of window {window} is missing or damaged")
    tmp = store.temp_file(store.output_path, ".mp4")
    try:
        with ExitStack() as fetched, _audio(store, run, manifest.has_audio) as audio:
            # Local files for the muxer: the segments themselves, or downloads of them from an object store.
            files = [str(fetched.enter_context(store.segment_path(w).fetch())) for w in range(plan.num_windows)]
            segments.join_segments(files, tmp, plan, audio, manifest.rotation, manifest.source.path)
        # Exclusive: two runs of one key may mux at once, and only one object may be published.
        store.commit_file(
            tmp, store.output_path, Stage.MUX, "all", time.perf_counter() - started, attempt, exclusive=True
        )
    finally:
        tmp.unlink(missing_ok=True)
    return StageResult(stage=Stage.MUX, computed=True, seconds=time.perf_counter() - started)


@task(name=TaskKind.PUBLISH, task_run_name="publish-{run.run_key}", **STAGE_TASK)
def publish(run: RunRef, destination: str) -> StageResult:
    """Copy the run's output to `destination` under a temporary name, then rename: no reader sees half a file. An
    object-store URL receives it as one object, published whole."""
    started = time.perf_counter()
    if is_url(destination):
        publish_to_url(_store(run).output_path, destination)
    else:
        publish_file(_store(run).output_path, Path(destination))
    return StageResult(stage=Stage.PUBLISH, computed=True, seconds=time.perf_counter() - started)


@task(name="workers-ready", cache_policy=NO_CACHE)
def workers_ready(model: ModelSpec | None = None) -> dict[str, str]:
    """Runs on a worker: proves it can import and run k6vsr's tasks before any tile is sent to it, and that
    `model`'s weights match its architecture. That check imports torch, so a client that only submits (to warm
    workers) leaves it to them; a bad model then fails the run here, with its own error, not each tile."""
    if model is not None:
        from service.runs import model_info

        model_info(model)
    return {"pid": str(os.getpid()), **library_versions()}
