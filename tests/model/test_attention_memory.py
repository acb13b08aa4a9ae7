"""The CUDA default's attention at a W1 tile, on the CPU: no single allocation of more than a few GiB.

Uncompiled, PyTorch's flex attention falls back to a dense implementation that materialises the attention matrix:
1 x 28 heads x 47,616 tokens squared, 236 GiB in fp32 at a W1 tile (768x512x121 at x2: 31 x 32 x 48 latent tokens).
That is what the README's GPU command hit on an H200, and the tiny bundle's shapes could never show it. Here the
released attention layer runs at that shape on fake tensors (no memory is touched) under a dispatch mode that
records every tensor an operation creates. A flex attention reached eagerly counts its dense fallback, run op by op;
inside a compiled region it is one fused Inductor kernel and counts only its outputs.

Dynamo does not trace under such a mode, so the compiled regions are stood for: the compiled DiT blocks by running
the layer as one compiled region, flex attention compiled alone by a stand-in for `fast.compiled_flex_attention`
(the last test checks that the real one is PyTorch's compiled flex attention).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from diffusers.models.transformers.transformer_kandinsky6_sr import (
    Kandinsky6SRAttention,
    Kandinsky6SRAttnProcessor,
    sliding_tile_mask,
)
from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop
from torch._higher_order_ops.flex_attention import sdpa_dense
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import flex_attention as flex_attention_module
from torch.nn.attention.flex_attention import flex_attention
from torch.utils._python_dispatch import TorchDispatchMode

from k6vsr_core.model import fast

# The released DiT (diffusers' class defaults): 1792 channels, 64 per head (28 heads), NABLA window and threshold.
MODEL_DIM, HEAD_DIM = 1792, 64
NABLA_WINDOW, NABLA_THRESHOLD = (11, 7, 7), 0.8
W1_TILE_TOKENS = (31, 32, 48)  # latent frames x rows x columns of a 512x768x121 output tile
BOUND = 4 << 30  # a few GiB: the largest tensor of the layer itself is 0.6 GiB


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operation creates; flex attention counted as it would run (see module doc)."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.where = ""
        self.compiled_depth = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is flex_attention_hop and self.compiled_depth == 0:
            with self:  # the eager fallback's own operations, recorded one by one
                out = sdpa_dense(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor):
                size = tensor.numel() * tensor.element_size()
                if size > self.largest:
                    self.largest, self.where = size, str(func)
        return out

    @contextmanager
    def in_compiled_graph(self) -> Iterator[None]:
        self.compiled_depth += 1
        try:
            yield
        finally:
            self.compiled_depth -= 1


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> LargestTensor:
    """The mode, with `fast.compiled_flex_attention` standing in as a compiled region of its own."""
    mode = LargestTensor()

    def fused_flex_attention(*args: Any, **kwargs: Any) -> Any:
        with mode.in_compiled_graph():
            return flex_attention(*args, **kwargs)

    monkeypatch.setattr(fast, "compiled_flex_attention", lambda: fused_flex_attention)
    # Eager flex attention wraps its operator in `torch.compile(backend="eager")`, which refuses to run under a
    # dispatch mode; this flag of PyTorch's calls the same operator directly, with the same dense fallback.
    monkeypatch.setattr(flex_attention_module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    return mode


def largest_allocation(recorder: LargestTensor, processor: Any, compiled_blocks: bool) -> int:
    """Run the released attention layer with `processor` at a W1 tile on fake CPU tensors; the largest tensor."""
    tokens = W1_TILE_TOKENS[0] * W1_TILE_TOKENS[1] * W1_TILE_TOKENS[2]
    default_dtype = torch.get_default_dtype()
    with FakeTensorMode():
        torch.set_default_dtype(torch.bfloat16)  # the weights as loaded on CUDA
        try:
            layer = Kandinsky6SRAttention(MODEL_DIM, HEAD_DIM, processor).requires_grad_(False)
        finally:
            torch.set_default_dtype(default_dtype)
        hidden = torch.empty(1, tokens, MODEL_DIM, dtype=torch.bfloat16)
        rope = torch.empty(tokens, 1, HEAD_DIM // 2, 2, 2, dtype=torch.float32)
        blocks = (W1_TILE_TOKENS[0], W1_TILE_TOKENS[1] // 8, W1_TILE_TOKENS[2] // 8)
        sparse = {
            "sta_mask": sliding_tile_mask(*blocks, NABLA_WINDOW, torch.device("cpu")),
            "threshold": NABLA_THRESHOLD,
        }
        region = recorder.in_compiled_graph() if compiled_blocks else contextlib.nullcontext()
        with recorder, region, torch.no_grad():
            out = layer(hidden, rope, sparse)
    assert tuple(out.shape) == (1, tokens, MODEL_DIM)
    return recorder.largest


def cuda_default(mode: str, compiled_blocks: bool) -> Any:
    """The processor `compile_bundle` gives a CUDA bundle, with its CUDA-only branch lifted to run on the CPU."""
    processor = fast.fast_processor(mode, compiled_blocks=compiled_blocks, use_cudnn=True)  # type: ignore[arg-type]
    processor.cuda_only = False
    return processor


@pytest.mark.parametrize("compiled_blocks", [True, False], ids=["compiled", "no-compile"])
@pytest.mark.parametrize("mode", ["nabla", "dense"])
def test_the_cuda_default_attention_at_a_w1_tile_allocates_no_attention_matrix(
    recorder: LargestTensor, mode: str, compiled_blocks: bool
) -> None:
    largest = largest_allocation(recorder, cuda_default(mode, compiled_blocks), compiled_blocks)
    assert largest < BOUND, f"{largest / 2**30:.1f} GiB in {recorder.where}"


def test_the_guard_sees_eager_flex_attention_build_the_matrix(recorder: LargestTensor) -> None:
    """diffusers' own processor, uncompiled (the CUDA default before `compile_bundle` ran on every path): the
    recorder must see the 236 GiB matrix, or the guard above could not fail."""
    largest = largest_allocation(recorder, Kandinsky6SRAttnProcessor(), compiled_blocks=False)
    assert largest > 200 << 30, f"{largest / 2**30:.1f} GiB in {recorder.where}"


def test_flex_attention_without_compiled_blocks_is_pytorchs_compiled_flex_attention() -> None:
    fast.compiled_flex_attention.cache_clear()
    compiled = fast.compiled_flex_attention()
    assert compiled._torchdynamo_orig_callable is flex_attention  # type: ignore[attr-defined]
    processor = fast.fast_processor("nabla", compiled_blocks=False, use_cudnn=True)
    assert processor.flex is compiled
    assert fast.fast_processor("nabla", compiled_blocks=True, use_cudnn=True).flex is flex_attention


@pytest.mark.parametrize("density", [0.27, 0.4])
def test_a_fixed_block_density_at_a_w1_tile_allocates_no_attention_matrix(
    recorder: LargestTensor, density: float
) -> None:
    """The benchmark's fixed-density mask (`fast.fixed_density_block_mask`) at the released shape, compiled blocks."""
    processor = cuda_default("nabla", compiled_blocks=True)
    processor.density = density
    largest = largest_allocation(recorder, processor, compiled_blocks=True)
    assert largest < BOUND, f"{largest / 2**30:.1f} GiB in {recorder.where}"
