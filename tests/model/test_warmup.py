"""Warm-up: `k6vsr workers start --model` runs every shape a default run compiles, so the first run compiles nothing.

The shapes are those the stages send through the bundle's compile watch (what `torch.compile` compiles per shape on
CUDA), recorded here on the CPU with the tiny bundle, with the decoder's own calls under a KVAE chunk as a budget
sets one. The model runs the tiny networks: each test decodes a few hundred thousand pixels at most.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from k6vsr_core import UpscaleParams, make_plan, upscale
from k6vsr_core.contract.plan import ModelTraits
from k6vsr_core.media.sample import make_sample_clip
from k6vsr_core.model.bundle import ModelBundle, model_traits
from service.runs import ModelSpec

Shape = tuple[str, tuple[int, ...], str]


class _Recorder:
    """A compile watch that records every (network, input shape, detail), and the decoder's own calls."""

    def __init__(self, bundle: ModelBundle) -> None:
        self.watched: list[Shape] = []
        self.decoder_calls: list[tuple[int, ...]] = []
        self._hook = bundle.vae.decoder.register_forward_pre_hook(
            lambda _module, args: self.decoder_calls.append(tuple(args[0].shape))
        )

    @contextmanager
    def __call__(self, component: str, shape: tuple[int, ...], detail: str) -> Iterator[None]:
        self.watched.append((component, shape, detail))
        yield

    def close(self) -> None:
        self._hook.remove()


@contextmanager
def recording(bundle: ModelBundle, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Recorder]:
    recorder = _Recorder(bundle)
    with monkeypatch.context() as patch:
        patch.setattr(bundle, "compile_watch", recorder, raising=False)
        try:
            yield recorder
        finally:
            recorder.close()


class _ChunkedBudget:
    """A budget's KVAE split on the CPU: 3 latent frames a decode call, so a 3-latent-frame window decodes as the
    first frame alone then a shorter last chunk of 2 (the encoder, never compiled, keeps its own call)."""

    take_turns = False
    room = None  # nothing for the memory gate to hold on the CPU

    def kvae_chunk(self, stage: str, size: tuple[int, int], frames: int) -> int | None:
        return 3 if stage == "decode" else None


# ------------------------------------------------------------------------------------------------- the plan


def test_the_warm_plan_is_a_default_request_on_one_full_window_of_the_largest_tile() -> None:
    from k6vsr_core.contract.warm_plan import warm_plan

    plan = warm_plan(ModelTraits())
    assert plan.params == UpscaleParams()
    assert plan.num_windows == 1 and plan.window_frames == 121 and plan.latent_frames == 31
    assert plan.grid.base == (512, 768) and plan.num_tiles == 1 and len(plan.chunks) == 1
    assert plan.steps == ModelTraits().trained_steps


def test_a_largest_tile_that_its_own_aspect_does_not_choose_is_refused_with_the_sizes() -> None:
    """Two tiles of one aspect: a source of that aspect gets the first listed, never the larger one."""
    from k6vsr_core.contract.warm_plan import warm_plan

    traits = ModelTraits(tile_sizes=((512, 768), (1024, 1536)))
    with pytest.raises(ValueError, match=r"warm-up plan for tile 1536x1024 \(WxH\) came out as .* of 768x512"):
        warm_plan(traits)


def _compiled(plan) -> tuple:
    """What decides a plan's compiled shapes: the DiT sees (tiles a chunk, latent frames, upscaled tile), the
    decoder one tile's latent (k6vsr_core.contract.warm_plan)."""
    from k6vsr_core.contract.warm_plan import warm_chunks

    upscaled = tuple(side * plan.grid.tiling_scale for side in plan.grid.latent_tile)
    return upscaled, plan.latent_frames, tuple(len(chunk.tiles) for chunk in warm_chunks(plan)), plan.params.attention


def test_the_warm_plan_covers_every_scale_and_every_window_of_a_landscape_clip() -> None:
    from k6vsr_core.contract.warm_plan import warm_plan

    warm = _compiled(warm_plan(ModelTraits()))
    for scale in (2, 2.25, 4):  # W1 (768x512), one window and three, 1080p
        for size, frames in (((512, 768), 121), ((512, 768), 331), ((1080, 1920), 121)):
            plan = make_plan(size, frames, 24.0, UpscaleParams(scale=scale))
            assert _compiled(plan) == warm, (scale, size, frames)
    # What it does not cover, and compiles on first use: another tile, a shorter clip, dense attention.
    assert _compiled(make_plan((768, 512), 121, 24.0, UpscaleParams())) != warm
    assert _compiled(make_plan((512, 768), 33, 24.0, UpscaleParams())) != warm
    assert _compiled(make_plan((512, 768), 121, 24.0, UpscaleParams(attention="dense"))) != warm


def test_the_warm_plan_gets_the_budget_and_decode_chunks_of_a_landscape_run_on_every_card() -> None:
    """The worker's bundle is placed under the warm plan's budget: a run under another would load a bundle of its
    own (`tasks.model_cache`), and its decode would split into other, unwarmed shapes."""
    from k6vsr_core.contract.warm_plan import warm_plan
    from k6vsr_core.model.memory import GIB, choose_budget

    warm = warm_plan(ModelTraits())
    runs = [
        make_plan((512, 768), 121, 24.0, UpscaleParams(scale=2)),
        make_plan((1080, 1920), 331, 24.0, UpscaleParams()),
    ]
    for card in (141, 80, 24, 16):
        budgets = [choose_budget("auto", card * GIB, plan) for plan in (warm, *runs)]
        assert len({(budget.budget, budget.limit, budget.decode_chunk) for budget in budgets}) == 1, card


def test_warm_chunks_take_one_chunk_of_each_size() -> None:
    from k6vsr_core.contract.warm_plan import warm_chunks

    plan = make_plan((512, 768), 121, 24.0, UpscaleParams(scale=2, tiles_batch_size=4))  # 9 tiles: 4, 4, 1
    assert [chunk.tiles for chunk in warm_chunks(plan)] == [(0, 1, 2, 3), (8,)]


# ------------------------------------------------------------------------------------------------- the warm-up


def test_warm_up_runs_each_shape_of_a_run_once(
    tiny_bundle: ModelBundle, clip_1f: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """clip_1f at x2 is 6 tiles: chunks of 4 and 2 tiles are two DiT shapes, every tile one decode shape."""
    from k6vsr_core.model.warmup import warm_up

    params = UpscaleParams(scale=2, tiles_batch_size=4)
    with recording(tiny_bundle, monkeypatch) as run:
        plan = upscale(clip_1f, None, tiny_bundle, params, return_frames=True).plan
    with recording(tiny_bundle, monkeypatch) as warm:
        done = warm_up(tiny_bundle, plan)
    assert set(warm.watched) == set(run.watched)
    assert set(warm.decoder_calls) == set(run.decoder_calls)
    assert done.shapes == 3 and len(warm.watched) == 2 * plan.steps + 1  # one call per shape
    assert len(run.watched) > len(warm.watched)


def test_warm_up_computes_with_the_threads_of_a_run_planned_here(
    tiny_bundle: ModelBundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiled graphs are guarded on torch's thread count: a warm-up under the worker's own count (its share of the
    cores) would leave a run, which applies its planning process's profile, to compile every graph again."""
    import torch

    from k6vsr_core.device.compute import default_profile
    from k6vsr_core.model import warmup

    seen: list[int] = []

    def denoise(bundle: ModelBundle, lr_tiles: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return lr_tiles

    monkeypatch.setattr(warmup.stages, "denoise_chunk", denoise)
    monkeypatch.setattr(warmup.stages, "decode_tile", lambda bundle, latent: seen.append(torch.get_num_threads()))
    threads = default_profile().cpu_threads
    torch.set_num_threads(threads + 1)
    try:
        plan = make_plan((64, 64), 1, 24.0, UpscaleParams(scale=2), model_traits(tiny_bundle.info))
        warmup.warm_up(tiny_bundle, plan)
    finally:
        torch.set_num_threads(threads)
    assert seen == [threads, threads]


def test_the_default_warm_up_leaves_nothing_to_compile_for_the_readme_command(
    tiny_bundle: ModelBundle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm plan (a 9-frame window of the smallest tile here, for the tiny decoder's speed) at the default
    x2.25, then the README's `--scale 2` on a clip of that tile's aspect under a budget that splits the decode: the
    run meets only warmed shapes, the decode's first single-frame call and its shorter last chunk included."""
    from k6vsr_core.contract import warm_plan as warm_plan_module
    from k6vsr_core.model.warmup import warm_up

    monkeypatch.setattr(warm_plan_module, "WARM_FRAMES", 9)
    monkeypatch.setattr(tiny_bundle, "memory", _ChunkedBudget())
    traits = model_traits(tiny_bundle.info).model_copy(update={"tile_sizes": ((128, 128),)})
    plan = warm_plan_module.warm_plan(traits)
    assert plan.params == UpscaleParams() and plan.num_tiles == 1
    clip = make_sample_clip(tmp_path / "square.mp4", width=64, height=64, num_frames=9, audio=False)
    with recording(tiny_bundle, monkeypatch) as warm:
        warm_up(tiny_bundle, plan)
    with recording(tiny_bundle, monkeypatch) as run:
        upscale(clip, None, tiny_bundle, UpscaleParams(scale=2), return_frames=True)
    assert set(run.watched) == set(warm.watched)
    assert set(run.decoder_calls) == set(warm.decoder_calls)
    assert sorted({shape[2] for shape in warm.decoder_calls}) == [1, 2]  # first frame alone, then a short chunk


# ------------------------------------------------------------------------------------------------- the preload


class _Calls:
    def __init__(self, bundle: ModelBundle) -> None:
        self.bundle = bundle
        self.placed: list[object] = []
        self.warmed: list[object] = []

    def get_bundle(self, spec: ModelSpec, plan: object = None) -> ModelBundle:
        self.placed.append(plan)
        return self.bundle

    def warm_up(self, bundle: ModelBundle, plan: object):
        from k6vsr_core.model.warmup import WarmUp

        self.warmed.append(plan)
        return WarmUp(shapes=2, seconds=0.0)


@pytest.mark.parametrize(
    ("device", "compiled", "warms"),
    [("cuda", True, True), ("cpu", True, False), ("cuda", False, False)],
)
def test_the_preload_warms_only_a_model_compiled_on_cuda(
    device: str, compiled: bool, warms: bool, tiny_bundle: ModelBundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    from k6vsr_core.contract.warm_plan import warm_plan
    from k6vsr_core.model import warmup
    from tasks import model_cache, worker_preload

    calls = _Calls(tiny_bundle)
    monkeypatch.setattr(model_cache, "get_bundle", calls.get_bundle)
    monkeypatch.setattr(model_cache, "resolve_device", lambda asked: device)
    monkeypatch.setattr(warmup, "warm_up", calls.warm_up)
    state = worker_preload.PreloadState(model="m")
    worker_preload.preload(ModelSpec(model="m", compile=compiled), state)
    assert state.done and state.error is None
    if warms:
        plan = warm_plan(model_traits(tiny_bundle.info))
        # Loaded, then placed under the budget of the plan it warms, then warmed with that plan.
        assert calls.placed == [None, plan] and calls.warmed == [plan] and state.warmed == 2
    else:
        assert calls.placed == [None] and calls.warmed == [] and state.warmed == 0


def test_the_preload_loads_places_and_warms_for_real(
    tiny_bundle_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the model cache, with the warm-up forced on the CPU: one DiT shape and one decode, logged."""
    from k6vsr_core.contract import warm_plan as warm_plan_module
    from tasks import model_cache, worker_preload

    monkeypatch.setattr(warm_plan_module, "WARM_FRAMES", 9)
    monkeypatch.setattr(warm_plan_module, "largest_tile", lambda traits: (128, 128))  # the smallest: fewer pixels
    monkeypatch.setattr(worker_preload, "warms", lambda spec: True)
    spec = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    state = worker_preload.PreloadState(model=spec.model)
    model_cache.clear()
    try:
        with caplog.at_level(logging.INFO, "k6vsr.workers"):
            worker_preload.preload(spec, state)
        assert state.done and state.error is None and state.warmed == 2
        assert any("warmed 2 shapes in" in record.getMessage() for record in caplog.records)
        assert len(model_cache.cache_info().loaded) == 1  # placed under the plan's budget, not loaded twice
    finally:
        model_cache.clear()


def test_a_failed_load_is_reported_and_the_preload_still_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks import model_cache, worker_preload

    def broken(spec: ModelSpec, plan: object = None) -> ModelBundle:
        raise OSError("no such model")

    monkeypatch.setattr(model_cache, "get_bundle", broken)
    state = worker_preload.PreloadState(model="m")
    worker_preload.preload(ModelSpec(model="m"), state)
    assert state.done and state.error == "OSError: no such model"


# ------------------------------------------------------------------------------------------------- the start


def test_the_supervisor_waits_for_every_worker_to_load_and_warm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker (in this process, so its preload can be slowed down) reports ready only once its preload ends."""
    from distributed import LocalCluster

    from runtime.warm_workers import wait_preloaded
    from tasks import worker_preload

    release = threading.Event()

    def slow_preload(spec: ModelSpec, state: worker_preload.PreloadState) -> None:
        release.wait(30)
        state.warmed, state.done = 2, True

    monkeypatch.setattr(worker_preload, "_STATE", None)
    monkeypatch.setattr(worker_preload, "preload", slow_preload)
    monkeypatch.setenv(worker_preload.MODEL_ENV, ModelSpec(model="m", device="cpu").model_dump_json())
    with LocalCluster(
        n_workers=1, processes=False, threads_per_worker=1, dashboard_address=None, preload=["tasks.worker_preload"]
    ) as cluster:
        answers: list[dict] = []
        waiter = threading.Thread(target=lambda: answers.append(wait_preloaded(cluster.scheduler_address, 1, bool)))
        waiter.start()
        time.sleep(1.5)
        still_waiting = not answers
        release.set()
        waiter.join(30)
        # A stop while the workers load ends the wait at once, with nothing.
        stopped = wait_preloaded(cluster.scheduler_address, 1, lambda: True)
    assert still_waiting and stopped == {}
    assert [state["warmed"] for state in answers[0].values()] == [2]


def _loading(tmp_path: Path):
    """A supervisor (this process) whose workers are up and loading /models/m, as its record says."""
    import os

    from runtime import state_folder, warm_workers
    from storage.processes import process_start

    folder = warm_workers._folder(tmp_path)
    folder.make()
    spec = ModelSpec(model="/models/m").model_dump_json()
    pid = os.getpid()
    record = warm_workers.WorkersRecord(
        pid=pid, process_start=process_start(pid), started_at=state_folder.now(), workers=1, model=spec
    )
    folder.write(record.model_copy(update={"loading_since": state_folder.now()}))
    return warm_workers, folder, record


def test_a_start_with_a_model_returns_only_once_the_supervisor_says_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    warm_workers, folder, record = _loading(tmp_path)
    monkeypatch.setenv("K6VSR_WORKERS_START_TIMEOUT", "1")  # the workers are up: loading may take longer
    monkeypatch.setattr(warm_workers, "_reachable", lambda address: True)

    def ready_later() -> None:
        time.sleep(2.0)
        folder.write(record.model_copy(update={"address": "tcp://127.0.0.1:1"}))

    writer = threading.Thread(target=ready_later)
    writer.start()
    started = time.monotonic()
    ready = warm_workers._wait_ready(folder, record)
    writer.join()
    assert ready.address == "tcp://127.0.0.1:1" and time.monotonic() - started >= 1.9


def test_a_warm_up_that_never_ends_times_out_with_its_own_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runtime.service_errors import WorkersError

    warm_workers, folder, record = _loading(tmp_path)
    stopped: list[int] = []
    monkeypatch.setenv("K6VSR_WORKERS_WARM_TIMEOUT", "0.5")
    monkeypatch.setattr(warm_workers, "_terminate", lambda record: stopped.append(record.pid))
    with pytest.raises(WorkersError, match=r"started but did not load and warm /models/m within 0.5 s"):
        warm_workers._wait_ready(folder, record)
    assert stopped == [record.pid] and folder.read(warm_workers.WorkersRecord) is None
