"""The bench-only stand-in for the networks (`bench.fake_model`): injected through the product's networks hook
(`k6vsr_core.model.networks`) and nowhere else, shaped as the real calls, and never sharing a run key with the real
model;
the product's modules never name it."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from bench import fake_model
from bench.fake_model import FAKE_ENV, FakeNetworks
from k6vsr_core import media
from k6vsr_core.contract.params import UpscaleParams
from k6vsr_core.errors import ParameterError
from k6vsr_core.media.sample import make_sample_clip
from k6vsr_core.model import networks, stages
from k6vsr_core.model.bundle import ModelBundle
from service.runs import ModelSpec, prepare_run

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("k6vsr_core", "storage", "service", "tasks", "runtime", "flows", "entrypoints")


def test_the_stand_in_is_injected_only_through_the_networks_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(networks.ENV, raising=False)
    monkeypatch.setenv(FAKE_ENV, "5")  # its milliseconds alone select nothing: the product does not read them
    assert networks.injected() is None and networks.current() is stages and networks.identity_mark() == ""
    monkeypatch.setenv(networks.ENV, fake_model.SPEC)
    injected = networks.current()
    assert isinstance(injected, FakeNetworks) and injected.ms == 5.0
    assert networks.identity_mark() == "+fake-model-5ms"
    for bad in ("fast", "-1", "1e9"):
        monkeypatch.setenv(FAKE_ENV, bad)
        with pytest.raises(ParameterError, match=FAKE_ENV):
            networks.current()
    monkeypatch.delenv(FAKE_ENV)
    with pytest.raises(ParameterError, match=FAKE_ENV):
        networks.current()


@pytest.mark.parametrize("spec", ["bench.fake_model", "bench.no_such_module:networks", "bench.fake_model:nothing"])
def test_a_hook_that_names_no_function_is_refused_naming_the_variable(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(networks.ENV, spec)
    with pytest.raises(ParameterError, match=re.escape(f"{networks.ENV}={spec!r}")):
        networks.current()


def test_no_product_module_names_the_stand_in() -> None:
    named = {}
    for room in PRODUCT:
        for path in sorted((ROOT / room).rglob("*.py")):
            found = re.findall(
                r"fake.model|FakeNetworks|FAKE_MODEL|BENCH_ONLY|\bbench\.", path.read_text("utf-8"), re.I
            )
            if found:
                named[str(path.relative_to(ROOT))] = found
    assert named == {}


def test_the_stand_in_has_the_real_shapes_and_its_own_run_key(
    tiny_bundle: ModelBundle, tiny_bundle_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(networks.ENV, raising=False)
    clip = make_sample_clip(tmp_path / "c.mp4", width=64, height=96, num_frames=3, audio=False)
    model = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    prepared = prepare_run(clip, UpscaleParams(scale=2), model, tmp_path / "store")
    plan = prepared.plan
    span = plan.windows[0]
    video = stages.prepare_window(media.read_frames(clip, plan.source_indices(span)), plan, span)
    fake = FakeNetworks(20.0)
    chunk = plan.chunks[0]

    real_latent = stages.encode_clip(tiny_bundle, video)
    started = time.perf_counter()
    fake_latent = fake.encode_clip(tiny_bundle, video)
    assert time.perf_counter() - started >= 0.02
    assert fake_latent.shape == real_latent.shape and fake_latent.dtype == real_latent.dtype
    lr_tiles = stages.cut_tiles(real_latent, plan, chunk.tiles)
    steps: list[int] = []
    real_tiles = stages.denoise_chunk(tiny_bundle, lr_tiles, chunk, plan)
    fake_tiles = fake.denoise_chunk(tiny_bundle, lr_tiles, chunk, plan, steps.append)
    assert fake_tiles.shape == real_tiles.shape and fake_tiles.dtype == real_tiles.dtype
    assert steps == list(range(plan.steps))
    real_pixels = stages.decode_tile(tiny_bundle, real_tiles[0])
    fake_pixels = fake.decode_tile(tiny_bundle, real_tiles[0])
    assert fake_pixels.shape == real_pixels.shape and fake_pixels.dtype == real_pixels.dtype == torch.uint8

    monkeypatch.setenv(FAKE_ENV, "20")
    unchanged = prepare_run(clip, UpscaleParams(scale=2), model, tmp_path / "store")
    assert unchanged.run.run_key == prepared.run.run_key  # the model's runs keep their keys
    for name, value in fake_model.environment(20.0).items():
        monkeypatch.setenv(name, value)
    faked = prepare_run(clip, UpscaleParams(scale=2), model, tmp_path / "store")
    assert faked.run.run_key != prepared.run.run_key and faked.plan == plan
