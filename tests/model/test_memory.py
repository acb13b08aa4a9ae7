"""Memory budgets (k6vsr_core.model.memory): the choice from synthetic cards, the same choice on every path whatever the
free memory, thread count or role of the process, and that no budget changes a byte of the output on the CPU, where
the offload hooks and the chunked KVAE run exactly as on a GPU."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from k6vsr_core.contract.params import parse_params
from k6vsr_core.contract.plan import ClipPlan, ModelTraits, make_plan
from k6vsr_core.device.gate import MemoryGate
from k6vsr_core.media.sample import make_sample_clip
from k6vsr_core.model.bundle import ModelBundle, load_bundle, model_traits
from k6vsr_core.model.memory import (
    BUDGETS,
    GIB,
    Footprint,
    MemoryBudget,
    MemoryBudgetError,
    apply_budget,
    budget_for,
    card_bytes,
    choose_budget,
)
from k6vsr_core.model.runner import upscale
from service.runs import ModelSpec
from tests.model.test_kvae import fixed_cpu_kernels

RELEASED = ModelTraits(tile_sizes=((512, 512), (512, 768), (768, 512)))


def _plan(size: tuple[int, int] = (512, 768), frames: int = 121, scale: float = 2, batch: int = 1) -> ClipPlan:
    return make_plan(size, frames, 24, parse_params(scale=scale, tiles_batch_size=batch), RELEASED)


W1 = _plan()


# --------------------------------------------------------------------------------------------------- the choice


def test_no_gpu_means_no_budget() -> None:
    budget = choose_budget("16g", None, W1)
    assert budget.budget is None and budget.decode_chunk is None and not budget.take_turns
    assert "no GPU" in budget.reason


@pytest.mark.parametrize(("card_gib", "expected"), [(139.0, "fast"), (40.0, "fast"), (23.0, "24g"), (15.0, "16g")])
def test_auto_takes_the_fastest_budget_that_fits(card_gib: float, expected: str) -> None:
    budget = choose_budget("auto", int(card_gib * GIB), W1, device="cuda:0")
    assert budget.mode == "auto" and budget.budget == expected
    assert budget.estimate is not None and budget.estimate <= min(card_gib * GIB, BUDGETS[expected].ceiling)
    assert f"{card_gib:.1f} GiB on cuda:0" in budget.reason
    skipped = list(BUDGETS)[: list(BUDGETS).index(expected)]
    assert all(f"{name} needs about" in budget.reason for name in skipped)


def test_auto_refuses_when_nothing_fits() -> None:
    with pytest.raises(MemoryBudgetError, match=r"8\.0 GiB on the GPU.*16g needs about"):
        choose_budget("auto", 8 * GIB, W1)


def test_an_explicit_budget_must_fit_the_card() -> None:
    budget = choose_budget("24g", 20 * GIB, W1)
    assert budget.budget == "24g" and budget.limit == 20 * GIB and budget.estimate <= 20 * GIB  # type: ignore[operator]
    with pytest.raises(MemoryBudgetError, match="memory=16g: 768x512 tiles of 121 frames need about"):
        choose_budget("16g", 10 * GIB, W1)
    with pytest.raises(MemoryBudgetError, match="not a memory mode"):
        choose_budget("12g", 10 * GIB, W1)  # type: ignore[arg-type]


@pytest.mark.parametrize("plan", [W1, _plan(frames=33), _plan(scale=4), _plan((512, 512), 9), _plan((1080, 1920))])
@pytest.mark.parametrize("name", list(BUDGETS))
def test_every_budget_keeps_its_estimate_under_its_ceiling(plan: ClipPlan, name: str) -> None:
    budget = choose_budget(name, 139 * GIB, plan)  # type: ignore[arg-type]
    assert budget.estimate is not None and budget.estimate <= BUDGETS[name].ceiling  # type: ignore[index]


def test_the_kvae_chunk_shrinks_with_the_budget() -> None:
    chunks = {name: choose_budget(name, 139 * GIB, W1).decode_chunk for name in BUDGETS}  # type: ignore[arg-type]
    order = [chunk or 32 for chunk in chunks.values()]
    assert chunks["16g"] == 1 and order[0] >= order[2] and order[1] >= order[2]
    # A short clip of small tiles decodes whole under the fast budget: nothing to save.
    small = make_plan((64, 96), 9, 24, parse_params(scale=2), ModelTraits(tile_sizes=((128, 128),)))
    assert choose_budget("fast", 139 * GIB, small).decode_chunk is None


def test_a_decode_is_budgeted_beside_a_denoise_wherever_stages_may_overlap() -> None:
    """Under `fast` a decode may run beside the next denoise: every process budgets for it (W1 decodes 1 latent frame
    a call), also one that runs one stage at a time, so that no process splits the decode's sums otherwise."""
    fast, turns = choose_budget("fast", 139 * GIB, W1), choose_budget("24g", 139 * GIB, W1)
    assert fast.overlap and not turns.overlap and not choose_budget("auto", None, W1).overlap
    assert fast.decode_chunk == fast.kvae_chunk("decode", (512, 768), 121) == 1
    assert fast.estimate is not None and fast.estimate <= 32 * GIB


def test_the_chunk_follows_each_tile_within_the_budget() -> None:
    budget = choose_budget("16g", 15 * GIB, W1)
    assert budget.kvae_chunk("decode", (512, 768), 121) == budget.decode_chunk == 1
    assert budget.kvae_chunk("decode", (128, 128), 121) is None
    assert budget.kvae_chunk("encode", W1.grid.padded_size, 121) == budget.encode_chunk


def test_the_memory_mode_is_a_runtime_choice_outside_the_run_key(tiny_bundle_path: Path, tmp_path: Path) -> None:
    from service.runs import prepare_run

    with pytest.raises(ValidationError):
        ModelSpec(memory="32g")  # type: ignore[arg-type]
    clip = make_sample_clip(tmp_path / "clip.mp4", width=64, height=64, num_frames=1)
    specs = [ModelSpec(model=str(tiny_bundle_path), memory=mode) for mode in ("auto", "fast", "24g", "16g")]
    keys = {prepare_run(clip, parse_params(scale=2), spec, tmp_path).run.run_key for spec in specs}
    assert len(keys) == 1


# --------------------------------------------------------------------------------------------------- on the CPU

# Sizes for the tiny model that make every budget split differently at 9 frames of 64x64 (x2, one 128x128 tile):
# 2.5 GiB per decoded tile frame and 2 GiB per encoded source frame, nothing else.
TINY_FOOTPRINT = Footprint(
    weights={"transformer": 0, "vae": 0, "latent_upscaler": 0},
    streamed_group=0,
    encode_per_pixel_frame=2 * GIB / (64 * 64),
    decode_per_pixel_frame=2.5 * GIB / (128 * 128),
    denoise_per_token=0,
    runtime=0,
    reserved_factor=1.0,
)


@pytest.fixture(scope="module")
def clip_9f(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sample_clip(tmp_path_factory.mktemp("memory") / "nine.mp4", width=64, height=64, num_frames=9)


def _budget(bundle: ModelBundle, mode: str) -> MemoryBudget:
    plan = make_plan((64, 64), 9, 24, parse_params(scale=2), model_traits(bundle.info))
    return choose_budget(mode, 30 * GIB, plan, footprint=TINY_FOOTPRINT)  # type: ignore[arg-type]


def test_every_memory_mode_gives_the_same_bytes_on_the_cpu(
    tiny_bundle: ModelBundle, tiny_bundle_path: Path, clip_9f: Path, tmp_path: Path
) -> None:
    budgets = {mode: _budget(tiny_bundle, mode) for mode in BUDGETS}
    chunks = {mode: (budget.encode_chunk, budget.decode_chunk) for mode, budget in budgets.items()}
    assert chunks == {"fast": (None, None), "24g": (None, 3), "16g": (1, 1)}  # the test covers every kind of split
    params = parse_params(scale=2)
    with fixed_cpu_kernels():
        reference = Path(upscale(clip_9f, tmp_path / "plain.mp4", tiny_bundle, params).output).read_bytes()
        for mode in ("auto", *BUDGETS):
            bundle = load_bundle(str(tiny_bundle_path))
            apply_budget(bundle, _budget(bundle, mode))
            output = upscale(clip_9f, tmp_path / f"{mode}.mp4", bundle, params).output
            assert Path(output).read_bytes() == reference, mode


def test_apply_budget_installs_library_hooks_once(tiny_bundle_path: Path) -> None:
    from diffusers.hooks import HookRegistry

    bundle = load_bundle(str(tiny_bundle_path))
    budget = _budget(bundle, "16g")
    apply_budget(bundle, budget)
    assert type(bundle) is ModelBundle and bundle.device == torch.device("cpu") and bundle.memory is budget
    assert HookRegistry.check_if_exists_or_initialize(bundle.latent_upscaler._models[0]).hooks  # group offload
    assert bundle.transformer._hf_hook.prev_module_hook.model is bundle.vae  # accelerate: each swaps the other out
    assert bundle.vae._hf_hook.prev_module_hook.model is bundle.transformer
    apply_budget(bundle, budget)  # the same budget again: nothing to do
    with pytest.raises(ValueError, match="already runs under memory budget 16g"):
        apply_budget(bundle, _budget(bundle, "fast"))


@pytest.mark.parametrize(("mode", "overlap"), [("fast", True), ("16g", False)])
def test_stages_take_turns_only_when_the_budget_says_so(tiny_bundle_path: Path, mode: str, overlap: bool) -> None:
    bundle = load_bundle(str(tiny_bundle_path))
    apply_budget(bundle, _budget(bundle, mode))
    pairing = [("decode", (128, 128), 9), ("denoise", (128, 128), 9)]  # the overlap the fast budget is chosen for
    assert _most_at_once(bundle, pairing) == (2 if overlap else 1)


def _most_at_once(bundle: ModelBundle, calls: list[tuple[str, tuple[int, int], int]], hold: float = 0.05) -> int:
    """The most of `calls` (stage, size, frames) that held the bundle's card at once, each started in a thread."""
    inside, most = 0, 0
    lock = threading.Lock()

    def call(stage: str, size: tuple[int, int], frames: int) -> None:
        nonlocal inside, most
        with bundle.on_gpu(stage, size, frames):  # type: ignore[arg-type]
            with lock:
                inside += 1
                most = max(most, inside)
            time.sleep(hold)
            with lock:
                inside -= 1

    threads = [threading.Thread(target=call, args=args) for args in calls]
    for thread in threads:
        thread.start()
        time.sleep(0.005)  # in this order
    for thread in threads:
        thread.join()
    return most


def test_every_pairing_the_scheduler_allows_stays_under_the_limit() -> None:
    """Two model tasks run at once per process (two denoise chunks, two decodes, an encode beside a decode...): the
    gate admits shares together only within the room the limit leaves beside the weights, and the pairing the KVAE
    chunk was chosen for (a decode beside one tile's denoise) is admitted, so it overlaps as before."""
    for plan in (W1, _plan(batch=4), _plan((1080, 1920)), _plan(scale=4)):
        budget = choose_budget("fast", 139 * GIB, plan)
        footprint = budget.footprint
        assert budget.limit is not None and budget.room is not None
        fixed = sum(footprint.weights.values()) + footprint.runtime  # everything resident under `fast`
        assert budget.room == int(budget.limit / footprint.reserved_factor) - fixed
        decode = budget.share("decode", plan.grid.base, plan.window_frames)
        one_tile = budget.share("denoise", plan.grid.base, plan.window_frames)
        chunk = budget.share("denoise", plan.grid.base, plan.window_frames, len(plan.chunks[0].tiles))
        assert 0 < one_tile <= chunk and decode + one_tile <= budget.room
        assert chunk == one_tile * len(plan.chunks[0].tiles)
    turns = choose_budget("24g", 139 * GIB, W1)
    assert turns.share("denoise", W1.grid.base, 121) == turns.room  # all of it: one stage at a time


def test_the_gate_admits_what_fits_in_arrival_order() -> None:
    gate = MemoryGate()
    log: list[tuple[str, str]] = []
    lock = threading.Lock()

    def call(name: str, share: int, hold: float) -> None:
        with gate.hold(share, room=10):
            with lock:
                log.append(("in", name))
            time.sleep(hold)
            with lock:
                log.append(("out", name))

    def run(calls: list[tuple[str, int, float]]) -> list[tuple[str, str]]:
        log.clear()
        threads = [threading.Thread(target=call, args=args) for args in calls]
        for thread in threads:
            thread.start()
            time.sleep(0.02)
        for thread in threads:
            thread.join()
        return list(log)

    # Two that fit run together; a third that does not waits for room.
    assert run([("a", 4, 0.2), ("b", 6, 0.2), ("c", 3, 0.05)])[:3] == [("in", "a"), ("in", "b"), ("out", "a")]
    # A call larger than the room runs alone rather than never.
    assert run([("big", 25, 0.05)]) == [("in", "big"), ("out", "big")]
    # First come first served: small calls that would fit do not overtake a large one that waits.
    order = run([("a", 6, 0.2), ("large", 8, 0.05), ("small", 2, 0.05)])
    assert order.index(("in", "small")) > order.index(("in", "large"))
    assert gate.running == 0


def test_a_pairing_that_does_not_fit_waits_at_the_gate(tiny_bundle_path: Path) -> None:
    """On a card whose room holds one decode but not two, the stages of one process decode one tile at a time, and a
    denoise still runs beside a decode."""
    bundle = load_bundle(str(tiny_bundle_path))
    budget = _budget(bundle, "fast")
    decode = budget.share("decode", (512, 768), 121)
    denoise = budget.share("denoise", (512, 768), 121)
    assert denoise < decode
    fixed = int(budget.limit / budget.footprint.reserved_factor) - budget.room  # type: ignore[operator]
    limit = int((fixed + decode + denoise + decode // 2) * budget.footprint.reserved_factor) + 1
    tight = budget.model_copy(update={"limit": limit})
    assert tight.room is not None and decode + denoise <= tight.room < 2 * decode
    apply_budget(bundle, tight)
    assert _most_at_once(bundle, [("decode", (512, 768), 121)] * 2) == 1
    assert _most_at_once(bundle, [("decode", (512, 768), 121), ("denoise", (512, 768), 121)]) == 2


def test_memory_flag_reaches_the_model_spec_and_bad_values_are_refused(capsys) -> None:
    from entrypoints.cli import build_parser
    from entrypoints.command_inputs import model_from

    args = build_parser().parse_args(["plan", "clip.mp4", "--memory", "16g"])
    assert model_from(args).memory == "16g"
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["plan", "clip.mp4", "--memory", "8g"])
    assert refused.value.code == 2
    assert "--memory" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- one budget on every path

H200 = 141 * GIB


def _fake_card(monkeypatch: pytest.MonkeyPatch, total: int, free: int, fraction: float = 1.0) -> None:
    """A CUDA card as torch reports it: its total, the driver's free figure and the process's memory fraction."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: fraction)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: total - free)


def _choice() -> dict:
    return budget_for("auto", torch.device("cuda"), W1).model_dump(exclude={"footprint"})


def test_the_card_decides_the_budget_not_free_memory_threads_or_the_process_role(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The KVAE chunks (and so the decode's bytes on a GPU) follow the card: not what is free when the worker
    starts, not torch's thread count, not whether the process is a one-thread Dask worker or the command."""
    from distributed import Client, LocalCluster

    _fake_card(monkeypatch, H200, free=H200 - GIB)
    reference = _choice()
    assert reference["budget"] == "fast" and reference["decode_chunk"] == 1
    assert card_bytes(torch.device("cuda")) == H200
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert _choice() == reference
    finally:
        torch.set_num_threads(threads)
    for free in (20 * GIB, 60 * GIB):  # another process holds most of the card, or some of it
        _fake_card(monkeypatch, H200, free=free)
        assert _choice() == reference
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster:
        with Client(cluster) as client:
            assert client.submit(_choice, pure=False).result(timeout=60) == reference
    # A smaller card, simulated as #29 does with a per-process fraction, is another card: its own budget.
    _fake_card(monkeypatch, H200, free=H200, fraction=23 / 141)
    assert _choice()["budget"] == "24g" and card_bytes(torch.device("cuda")) <= 23 * GIB


@pytest.fixture
def on_a_card(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process sees an H200's worth of memory, also on the CPU: the budgets and chunks are then applied to
    the tiny bundle as they would be on the card (offload hooks and chunked KVAE run on the CPU too)."""
    from k6vsr_core.model import memory
    from tasks import model_cache

    monkeypatch.setattr(memory, "card_bytes", lambda device: H200)
    model_cache.clear()
    yield
    model_cache.clear()


def test_the_command_a_worker_and_the_in_memory_runner_place_a_clip_under_one_budget(
    on_a_card: None, monkeypatch: pytest.MonkeyPatch, tiny_bundle_path: Path, clip_1f: Path
) -> None:
    """The model cache (a command's threads, a one-thread Dask worker) and the in-memory runner place the bundle under
    the same budget and split the KVAE's work the same way for the same clip."""
    from distributed import Client, LocalCluster

    from k6vsr_core.model import stages
    from tasks import model_cache

    spec = ModelSpec(model=str(tiny_bundle_path), device="cpu")

    def split(budget: MemoryBudget, plan: ClipPlan) -> tuple:
        frames = plan.window_frames
        return (
            budget.budget,
            budget.limit,
            budget.kvae_chunk("encode", plan.grid.padded_size, frames),
            budget.kvae_chunk("decode", plan.grid.base, frames),
        )

    def placed(plan: ClipPlan) -> tuple:
        return split(model_cache.get_bundle(spec, plan).memory, plan)

    command = placed(W1)
    assert command == ("fast", 32 * GIB, None, 1)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster:
        with Client(cluster) as client:
            assert client.submit(placed, W1, pure=False).result(timeout=60) == command
    # The runner places its bundle before the first stage; the stages themselves are not this test's business.
    bundle, plans = load_bundle(str(tiny_bundle_path)), []

    def stop(bundle: ModelBundle, video: torch.Tensor) -> None:
        raise StopIteration

    monkeypatch.setattr(stages, "encode_clip", stop)
    monkeypatch.setattr(stages, "prepare_window", lambda frames, plan, window: plans.append(plan))
    with pytest.raises(StopIteration):
        upscale(clip_1f, None, bundle, parse_params(scale=2), return_frames=True)
    assert split(bundle.memory, plans[0]) == placed(plans[0])


def test_a_worker_gives_a_clip_with_another_budget_a_bundle_of_its_own(
    on_a_card: None, monkeypatch: pytest.MonkeyPatch, tiny_bundle_path: Path
) -> None:
    """A worker never runs a clip under the budget chosen for the clip it ran before: on this card W1 takes `24g`,
    a short clip of small tiles `fast`, whichever came first."""
    from k6vsr_core.model import memory
    from tasks import model_cache

    monkeypatch.setattr(memory, "card_bytes", lambda device: 23 * GIB)
    short = _plan((512, 512), 9)
    spec = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    first = model_cache.get_bundle(spec, short)
    second = model_cache.get_bundle(spec, W1)
    assert (first.memory.budget, second.memory.budget) == ("fast", "24g") and first is not second
    assert model_cache.get_bundle(spec, short) is first and model_cache.get_bundle(spec, W1) is second
    assert [name.rsplit(" ", 1)[-1] for name in model_cache.cache_info().loaded] == ["(fast)", "(24g)"]


def test_processes_get_expandable_segments_and_the_compile_cache_unless_the_environment_chose(tmp_path: Path) -> None:
    """Importing k6vsr_core sets the allocator's settings and Inductor's cache folder before any of its modules
    imports torch, so the command's own process, every process it starts (warm workers, Dask workers and job
    processes inherit its environment) and any that runs k6vsr's tasks have them; a value the user set is kept.
    Without it, importing torch's flex attention set torch's default (/tmp/torchinductor_<user>) first, and a one-shot
    compiled the decoder again beside an imported cache (79 s, H200)."""
    import subprocess
    import sys

    from k6vsr_core.device.process_env import ALLOC_ENV, ALLOCATOR_DEFAULT, COMPILE_CACHE_ENV, INDUCTOR_CACHE_ENV

    code = f"import os, tasks.model_cache; print(os.environ[{ALLOC_ENV!r}], os.environ[{INDUCTOR_CACHE_ENV!r}])"
    bare = {key: value for key, value in os.environ.items() if key not in (ALLOC_ENV, INDUCTOR_CACHE_ENV)}
    bare[COMPILE_CACHE_ENV] = str(tmp_path / "compile")
    chosen = {**bare, ALLOC_ENV: "max_split_size_mb:128", INDUCTOR_CACHE_ENV: str(tmp_path / "mine")}
    for env, expected in (
        (bare, [ALLOCATOR_DEFAULT, str(tmp_path / "compile" / "inductor")]),
        (chosen, ["max_split_size_mb:128", str(tmp_path / "mine")]),
    ):
        child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert child.stdout.split() == expected, child.stderr[-2000:]
