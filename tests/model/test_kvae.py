"""The KVAE in temporal chunks through its causal cache (k6vsr_core.model.kvae) against the KVAE's own encode and
decode.

Under fixed CPU kernels (one thread, no oneDNN) every chunking gives the very same bits as the KVAE's own call: the
cache carries exactly what the next piece needs. With the default kernels the backend may pick another kernel for
a piece of another length, which changes the last float bits only.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from k6vsr_core.model import kvae
from k6vsr_core.model.bundle import ModelBundle


@contextmanager
def fixed_cpu_kernels() -> Iterator[None]:
    """One thread and no oneDNN: CPU convolutions whose rounding does not depend on the input's length."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
            with torch.backends.mkldnn.flags(enabled=False):
                yield
    finally:
        torch.set_num_threads(threads)


def _random(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _keep(decoded: torch.Tensor) -> torch.Tensor:
    return decoded.clone()


@pytest.mark.parametrize(
    ("total", "first", "step", "expected"),
    [(1, 1, 4, [1]), (9, 1, 4, [1, 4, 4]), (9, 1, 8, [1, 8]), (17, 1, 12, [1, 12, 4]), (31, 1, 2, [1] + [2] * 15)],
)
def test_segments(total: int, first: int, step: int, expected: list[int]) -> None:
    assert kvae.segments(total, first, step) == expected


@pytest.mark.parametrize("latent_frames", [3, 6])
def test_chunked_decode_is_bit_exact_under_fixed_kernels(tiny_bundle: ModelBundle, latent_frames: int) -> None:
    vae = tiny_bundle.vae
    latent = _random((1, 64, latent_frames, 4, 4), latent_frames)
    with torch.no_grad(), fixed_cpu_kernels():
        whole = vae.decode(latent, return_dict=False)[0]
        assert torch.equal(kvae.decode(vae, latent, None, _keep), whole)
        for chunk in (1, 2, 3):
            assert torch.equal(kvae.decode(vae, latent, chunk, _keep), whole), chunk
    assert whole.shape == (1, 3, 1 + 4 * (latent_frames - 1), 64, 64)


def test_chunked_decode_finishes_each_piece(tiny_bundle: ModelBundle) -> None:
    seen: list[int] = []

    def finish(piece: torch.Tensor) -> torch.Tensor:
        seen.append(piece.shape[2])
        return piece[:, :, :1]

    with torch.no_grad(), fixed_cpu_kernels():
        out = kvae.decode(tiny_bundle.vae, _random((1, 64, 4, 4, 4), 1), 2, finish)
    assert seen == [1, 8, 4] and out.shape[2] == 3


@pytest.mark.parametrize("frames", [9, 17])
def test_chunked_encode_is_bit_exact_under_fixed_kernels(tiny_bundle: ModelBundle, frames: int) -> None:
    vae = tiny_bundle.vae
    pixels = torch.rand((1, 3, frames, 64, 96), generator=torch.Generator().manual_seed(frames)) * 2 - 1
    with torch.no_grad(), fixed_cpu_kernels():
        whole = vae.encode(pixels, return_dict=False)[0].mode()
        for chunk in (None, 1, 2, 3):
            assert torch.equal(kvae.encode(vae, pixels, chunk), whole), chunk


def test_chunked_decode_with_default_kernels_differs_in_the_last_bits_only(tiny_bundle: ModelBundle) -> None:
    vae = tiny_bundle.vae
    latent = _random((1, 64, 3, 4, 4), 7)
    with torch.no_grad():
        whole = vae.decode(latent, return_dict=False)[0]
        chunked = kvae.decode(vae, latent, 1, _keep)
    assert float((chunked - whole).abs().max()) < 1e-4
