"""`precision`: bf16 as released, or the DiT's linear layers in FP8 where the GPU has FP8
(k6vsr_core.device.precision)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from k6vsr_core.contract.params import parse_params
from k6vsr_core.contract.plan import ModelTraits, make_plan
from k6vsr_core.contract.release_config import released_configs
from k6vsr_core.device import precision
from k6vsr_core.errors import ParameterError, UserFacingError
from k6vsr_core.model import stages
from k6vsr_core.model.bundle import ModelBundle, load_bundle, model_traits, transformer_kwargs
from k6vsr_core.model.memory import BUDGETS
from storage.manifest import output_params, run_key


def test_fp8_is_refused_on_a_cpu_with_the_reason() -> None:
    with pytest.raises(precision.PrecisionUnavailable, match=r"precision=fp8 cannot run here: .*compute capability"):
        precision.check_precision("fp8", torch.device("cpu"))
    precision.check_precision("bf16", torch.device("cpu"))
    assert issubclass(precision.PrecisionUnavailable, UserFacingError)


def test_the_worker_refuses_fp8_before_loading_any_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.runs import ModelSpec
    from tasks import model_cache

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights loaded for a request this device cannot run")

    monkeypatch.setattr(model_cache, "load_bundle", no_load)
    plan = make_plan((64, 96), 9, 24, parse_params(scale=2, precision="fp8"), ModelTraits())
    with pytest.raises(precision.PrecisionUnavailable, match="fp8"):
        model_cache.get_bundle(ModelSpec(model="/nonexistent", device="cpu"), plan)


def test_precision_is_a_request_value_and_keys_fp8_runs_apart() -> None:
    with pytest.raises(ParameterError, match="precision"):
        parse_params(precision="fp16")
    bf16, fp8 = parse_params(scale=2), parse_params(scale=2, precision="fp8")
    assert bf16.precision == "bf16"
    # bf16 keeps the keys of runs made before the option existed; fp8 computes other values, so another run.
    assert "precision" not in output_params(bf16)
    assert run_key("s", bf16, "m") != run_key("s", fp8, "m")


def test_fp8_layers_are_the_blocks_token_wise_linear_layers_of_the_released_dit() -> None:
    from diffusers import Kandinsky6SRTransformer3DModel

    with torch.device("meta"):
        dit = Kandinsky6SRTransformer3DModel(**transformer_kwargs(released_configs()["transformer"]))
    chosen = [name for name, module in dit.named_modules() if precision.fp8_layer(module, name)]
    blocks = len(dit.visual_transformer_blocks)
    assert len(chosen) == len(precision.FP8_LAYERS) * blocks == 6 * 32
    assert not any("modulation" in name or "embedding" in name for name in chosen)
    flops = sum(m.weight.numel() for n, m in dit.named_modules() if precision.fp8_layer(m, n))
    linear = sum(
        m.weight.numel() for n, m in dit.named_modules() if isinstance(m, torch.nn.Linear) and "modulation" not in n
    )
    assert flops / linear > 0.95  # nearly all of the per-token matrix work


def test_fp8_needs_the_dit_resident(tiny_bundle_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = load_bundle(str(tiny_bundle_path))
    monkeypatch.setattr(precision, "fp8_unavailable", lambda device: None)
    bundle.memory = type("Budget", (), {"layout": BUDGETS["16g"], "budget": "16g"})()
    with pytest.raises(precision.PrecisionUnavailable, match="resident"):
        precision.dit_for(bundle, "fp8")


def test_an_fp8_request_runs_on_its_own_copy_of_the_dit(
    tiny_bundle_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plumbing, with a stand-in for torchao's conversion (FP8 needs a GPU): the copy is made once, switched to
    the request's attention, computes the request, and leaves the bf16 DiT as it was."""
    bundle: ModelBundle = load_bundle(str(tiny_bundle_path))
    made: list[object] = []

    def stand_in(transformer: torch.nn.Module, compiled: bool) -> torch.nn.Module:
        made.append(transformer)
        return copy.deepcopy(transformer)

    monkeypatch.setattr(precision, "fp8_unavailable", lambda device: None)
    monkeypatch.setattr(precision, "fp8_transformer", stand_in)
    traits = model_traits(bundle.info)
    plans = {p: make_plan((64, 96), 9, 24, parse_params(scale=2, precision=p), traits) for p in ("bf16", "fp8")}
    chunk = plans["bf16"].chunks[0]
    th, tw = plans["bf16"].grid.latent_tile
    lr = torch.randn(
        (len(chunk.tiles), 64, plans["bf16"].latent_frames, th, tw), generator=torch.Generator().manual_seed(2)
    )
    want = stages.denoise_chunk(bundle, lr, chunk, plans["bf16"])
    got = stages.denoise_chunk(bundle, lr, chunk, plans["fp8"])
    stages.denoise_chunk(bundle, lr, chunk, plans["fp8"])
    assert made == [bundle.transformer]  # one copy, of the bf16 DiT
    copy_of = precision.dit_for(bundle, "fp8")
    assert copy_of is not bundle.transformer
    # The stand-in copies exactly, so the request computes the bf16 values (the CPU's kernels may round the copy's
    # arithmetic apart in the last bits: other buffers, other alignment).
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
