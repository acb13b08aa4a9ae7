"""The bench-only stand-in for the networks (`k6vsr_core.fake_model`): selected only on purpose, shaped as the real
calls, and never sharing a run key with the real model."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from k6vsr_core import media, stages
from k6vsr_core.bundle import ModelBundle
from k6vsr_core.errors import ParameterError
from k6vsr_core.fake_model import FAKE_ENV, MARKER_ENV, FakeNetworks, fake_ms
from k6vsr_core.params import UpscaleParams
from k6vsr_core.sample import make_sample_clip
from service.runs import ModelSpec, prepare_run


def test_the_stand_in_needs_the_bench_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAKE_ENV, raising=False)
    monkeypatch.delenv(MARKER_ENV, raising=False)
    assert fake_ms() is None
    monkeypatch.setenv(FAKE_ENV, "5")
    with pytest.raises(ParameterError, match=MARKER_ENV):
        fake_ms()
    monkeypatch.setenv(MARKER_ENV, "1")
    assert fake_ms() == 5.0
    for bad in ("fast", "-1", "1e9"):
        monkeypatch.setenv(FAKE_ENV, bad)
        with pytest.raises(ParameterError, match=FAKE_ENV):
            fake_ms()


def test_the_stand_in_has_the_real_shapes_and_its_own_run_key(
    tiny_bundle: ModelBundle, tiny_bundle_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(FAKE_ENV, raising=False)
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
    monkeypatch.setenv(MARKER_ENV, "1")
    faked = prepare_run(clip, UpscaleParams(scale=2), model, tmp_path / "store")
    assert faked.run.run_key != prepared.run.run_key and faked.plan == plan
