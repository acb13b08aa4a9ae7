"""The benchmark's fixed block density (`k6vsr_core.model.fast.fixed_density_block_mask`): which blocks it keeps.

The kernels' arithmetic under such a mask is measured on the GPU (`bench/network_profile.py --sections attention`):
PyTorch's eager flex attention on the CPU applies only a mask's `mask_mod`, not its block pattern."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers.models.transformers.transformer_kandinsky6_sr import sliding_tile_mask

from bench.run_bench import dense_block_mask
from k6vsr_core.model import fast

BLOCK = 64


def qkv(blocks: int, heads: int = 2, dim: int = 16) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(3)
    return tuple(torch.randn((1, heads, blocks * BLOCK, dim), generator=generator) for _ in range(3))


def sta(frames: int, rows: int, cols: int) -> torch.Tensor:
    return sliding_tile_mask(frames, rows, cols, (1, 1, 1), torch.device("cpu"))


@pytest.mark.parametrize("density", [0.1, 0.27, 0.4, 1.0])
def test_each_query_block_keeps_its_strongest_blocks_and_the_sta_prior(density: float) -> None:
    q, k, _ = qkv(blocks=12)
    prior = sta(3, 2, 2)  # 12 blocks, each near itself only
    mask = fast.fixed_density_block_mask(q, k, prior, density)
    kept = dense_block_mask(mask)
    scores = q.reshape(1, 2, 12, BLOCK, -1).mean(-2) @ k.reshape(1, 2, 12, BLOCK, -1).mean(-2).transpose(-2, -1)
    strongest = scores.topk(math.ceil(density * 12), dim=-1).indices
    assert kept.gather(-1, strongest).all()
    assert (kept | ~prior).all()
    assert (kept.sum(-1) >= math.ceil(density * 12)).all()
    assert (kept.sum(-1) <= math.ceil(density * 12) + prior.sum(-1)).all()
    # Every kept block is filed as a full block (no partial ones), as diffusers' NABLA mask does.
    assert torch.equal(mask.full_kv_num_blocks, kept.sum(-1).to(torch.int32))
    assert not mask.kv_num_blocks.any()


def test_the_mask_is_exactly_the_strongest_blocks_and_the_prior() -> None:
    q, k, _ = qkv(blocks=6)
    prior = sta(6, 1, 1)
    mask = fast.fixed_density_block_mask(q, k, prior, 0.34)
    scores = q.reshape(1, 2, 6, BLOCK, -1).mean(-2) @ k.reshape(1, 2, 6, BLOCK, -1).mean(-2).transpose(-2, -1)
    expected = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, scores.topk(3, dim=-1).indices, True) | prior
    assert torch.equal(mask.to_dense().bool(), expected)
    assert not expected.all(), "the mask must leave blocks out, or the comparison proves nothing"


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5])
def test_a_density_outside_zero_to_one_is_refused(density: float) -> None:
    q, k, _ = qkv(blocks=2)
    with pytest.raises(ValueError, match="block density must be in"):
        fast.fixed_density_block_mask(q, k, sta(2, 1, 1), density)


def test_the_switch_sets_and_clears_the_density_on_every_layer() -> None:
    class Attention(torch.nn.Module):
        pass

    switch = fast.AttentionSwitch(torch.nn.Module(), compiled_blocks=True)
    switch._processors[id(switch.transformer)] = {"nabla": [fast.FastNablaProcessor() for _ in range(3)], "dense": []}
    switch.nabla_settings(density=0.4)
    assert [p.density for p in switch.processors["nabla"]] == [0.4] * 3
    switch.nabla_settings()
    assert [p.density for p in switch.processors["nabla"]] == [None] * 3
