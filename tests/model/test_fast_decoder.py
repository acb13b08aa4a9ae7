"""The KVAE decoder's fast forms (k6vsr_core.model.fast_decoder) compute diffusers' decoder: same values, same
shapes."""

from __future__ import annotations

import copy

import pytest
import torch

from k6vsr_core.contract.release_config import released_configs
from k6vsr_core.model import fast_decoder, kvae
from k6vsr_core.model.bundle import ModelBundle, vae_kwargs


def _keep(decoded: torch.Tensor) -> torch.Tensor:
    return decoded.clone()


def _latent(frames: int, seed: int = 3) -> torch.Tensor:
    return torch.randn((1, 64, frames, 4, 6), generator=torch.Generator().manual_seed(seed))


@pytest.fixture()
def fused_vae(tiny_bundle: ModelBundle) -> torch.nn.Module:
    vae = copy.deepcopy(tiny_bundle.vae)
    assert fast_decoder.fuse_decoder(vae.decoder, channels_last=False) > 0
    return vae


@pytest.mark.parametrize("chunk", [None, 1, 2, 3])
def test_fused_decoder_gives_the_decoders_values_in_every_chunking(
    tiny_bundle: ModelBundle, fused_vae: torch.nn.Module, chunk: int | None
) -> None:
    latent = _latent(6)
    with torch.no_grad():
        want = kvae.decode(tiny_bundle.vae, latent, chunk, _keep)
        got = kvae.decode(fused_vae, latent, chunk, _keep)
    assert got.shape == want.shape
    # The same sums of the same products; fp32 convolutions of another input size may round the last bits apart.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_decoder_keeps_the_time_chunked_convolution_for_huge_inputs(
    tiny_bundle: ModelBundle, fused_vae: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    latent = _latent(3)
    with torch.no_grad():
        want = kvae.decode(tiny_bundle.vae, latent, 2, _keep)
        monkeypatch.setattr(fast_decoder, "CONV_CHUNK_ELEMENTS", 20_000)
        got = kvae.decode(fused_vae, latent, 2, _keep)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fuse_decoder_changes_the_decoder_only_and_once(tiny_bundle: ModelBundle) -> None:
    vae = copy.deepcopy(tiny_bundle.vae)
    changed = fast_decoder.fuse_decoder(vae.decoder)
    assert fast_decoder.fuse_decoder(vae.decoder) == 0
    assert not any(getattr(module, "_k6vsr_fused", False) for module in vae.encoder.modules())
    norms = sum(isinstance(m, fast_decoder.Kandinsky6SRSpatialNorm3D) for m in vae.decoder.modules())
    convs = sum(isinstance(m, fast_decoder.Kandinsky6SRCausalConv3d) for m in vae.decoder.modules())
    assert changed == norms + convs


def test_fused_full_size_decoder_keeps_w1s_shapes_in_every_piece() -> None:
    """The released decoder, fused, on W1's tile latent (31 frames, 32x48) in the pieces a run decodes: on the meta
    device, so the full-size arithmetic costs nothing."""
    from diffusers import Kandinsky6SRVAE

    with torch.device("meta"):
        vae = Kandinsky6SRVAE(**vae_kwargs(released_configs()["vae"])).to(torch.bfloat16)
        fast_decoder.fuse_decoder(vae.decoder)
        latent = torch.empty((1, 64, 31, 32, 48), dtype=torch.bfloat16)
        with torch.no_grad():
            pieces = []
            out = kvae.decode(vae, latent, 4, lambda piece: pieces.append(piece.shape) or piece)
    assert tuple(out.shape) == (1, 3, 121, 512, 768)
    assert [shape[2] for shape in pieces] == [1] + [16] * 7 + [8]


@pytest.mark.parametrize("chunk", [None, 2])
def test_channels_last_decoder_gives_the_decoders_values_channels_first(
    tiny_bundle: ModelBundle, chunk: int | None
) -> None:
    vae = copy.deepcopy(tiny_bundle.vae)
    fast_decoder.fuse_decoder(vae.decoder, channels_last=True)
    conv = next(m for m in vae.decoder.modules() if isinstance(m, torch.nn.Conv3d) and m.weight.shape[-1] == 3)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last_3d)
    latent = _latent(4)
    with torch.no_grad():
        want = kvae.decode(tiny_bundle.vae, latent, chunk, _keep)
        got = kvae.decode(vae, latent, chunk, _keep)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_layout_switch_keeps_channels_first_for_measuring(
    tiny_bundle: ModelBundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(fast_decoder.LAYOUT_ENV, "channels_first")
    vae = copy.deepcopy(tiny_bundle.vae)
    assert fast_decoder.fuse_decoder(vae.decoder) > 0
    assert not getattr(vae.decoder, "_k6vsr_channels_last", False)
    assert all(m.weight.is_contiguous() for m in vae.decoder.modules() if isinstance(m, torch.nn.Conv3d))
