"""KVAE encode and decode in temporal chunks, through the model's own causal cache.

The KVAE is causal in time: every causal convolution keeps the last frames of its input in a cache dict, so a
video fed in consecutive pieces gives the values of one pass. diffusers' `Kandinsky6SRVAE.encode`/`decode` already
feed 1 + 16 pixel frames a call this way; here the first frame goes alone and then `chunk` latent frames (4*chunk
pixel frames) a call, so activation memory follows the chunk, not the clip. `chunk=None` is the KVAE's own call.

The values are the same; the rounding may not be. A convolution backend may pick another kernel for an input of
another length (cuDNN, Inductor, and oneDNN or BLAS on a CPU), which changes the last bits: `tests/model/test_kvae.py`
shows the chunked results bit-identical under fixed CPU kernels, and `bench/memory_bench.py` measures the GPU
difference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from diffusers.utils.accelerate_utils import apply_forward_hook

from k6vsr_core.contract.plan import TEMPORAL_FACTOR


def segments(total: int, first: int, step: int) -> list[int]:
    """`first` alone, then pieces of `step`, the last one shorter: lengths that sum to `total`."""
    lengths = [min(first, total)]
    remaining = total - lengths[0]
    while remaining > 0:
        lengths.append(min(step, remaining))
        remaining -= step
    return lengths


# `apply_forward_hook` is what diffusers puts on the KVAE's own encode/decode: an offload hook on the KVAE (see
# k6vsr_core.model.memory) brings it onto the GPU before the first chunk, as it would for those methods.


@apply_forward_hook
def encode(vae: Any, pixels: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """The latent mode of `pixels` (1, 3, T, H, W) in [-1, 1], `chunk` latent frames a call."""
    if chunk is None:
        return vae.encode(pixels, return_dict=False)[0].mode()
    cache = vae.encoder.make_cache()
    pieces = torch.split(pixels, segments(pixels.shape[2], 1, TEMPORAL_FACTOR * chunk), dim=2)
    moments = torch.cat([vae.encoder(piece, cache) for piece in pieces], dim=2)
    return DiagonalGaussianDistribution(moments).mode()


@apply_forward_hook
def decode(
    vae: Any, latent: torch.Tensor, chunk: int | None, finish: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Decode `latent` (1, C, t, h, w), `chunk` latent frames a call; `finish` turns each decoded piece into what
    is kept (e.g. uint8 on the CPU) before the next piece is decoded. The finished pieces, joined along time."""
    if chunk is None:
        return finish(vae.decode(latent, return_dict=False)[0])
    cache = vae.decoder.make_cache()
    pieces = torch.split(latent, segments(latent.shape[2], 1, chunk), dim=2)
    return torch.cat([finish(vae.decoder(piece, cache)) for piece in pieces], dim=2)
