"""Attention modes of the SR DiT: NABLA sparse attention (the release's own) or dense SDPA.

NABLA is diffusers' own processor (flex attention with a per-sample block mask); diffusers 0.42.1 already picks the
flex kernel options (BLOCK_M = BLOCK_N = 64) that let it compile on torch 2.11. Dense attention is the same
projection, norm and rotary arithmetic with PyTorch's `scaled_dot_product_attention`, which dispatches to the best
fused kernel for the shape (cuDNN on Hopper) and needs no compile. Dense attention is not bit-equal to NABLA: it
attends to every block, which NABLA approximates.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_kandinsky6_sr import (
    Kandinsky6SRAttention,
    Kandinsky6SRAttnProcessor,
    apply_rotary,
)

AttentionMode = Literal["nabla", "dense"]


def project_qkv(
    attn: Any, hidden_states: torch.Tensor, rotary_emb: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The SR attention's query, key and value in `(B, heads, S, D)`: projections, fp32 RMS norms, rotary.

    The same arithmetic as `Kandinsky6SRAttnProcessor`, shared by every processor here.
    """
    query = attn.to_query(hidden_states).unflatten(-1, (attn.num_heads, -1))
    key = attn.to_key(hidden_states).unflatten(-1, (attn.num_heads, -1))
    value = attn.to_value(hidden_states).unflatten(-1, (attn.num_heads, -1))
    query = attn.query_norm(query.float()).type_as(query)
    key = attn.key_norm(key.float()).type_as(key)
    query = apply_rotary(query, rotary_emb)
    key = apply_rotary(key, rotary_emb)
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


class DenseSdpaProcessor:
    """`Kandinsky6SRAttnProcessor` with dense SDPA in place of the NABLA block mask."""

    _parallel_config = None

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(query, key, value)

    def __call__(
        self, attn: Any, hidden_states: torch.Tensor, rotary_emb: torch.Tensor, sparse_params: Any
    ) -> torch.Tensor:
        out = self.attend(*project_qkv(attn, hidden_states, rotary_emb))
        return attn.out_layer(out.transpose(1, 2).flatten(2, 3))


def set_attention(transformer: Any, mode: AttentionMode) -> None:
    """Switch every attention layer of the DiT to `mode` (idempotent)."""
    if mode not in ("nabla", "dense"):
        raise ValueError(f"attention={mode!r} is not known; allowed: nabla or dense")
    wanted = Kandinsky6SRAttnProcessor if mode == "nabla" else DenseSdpaProcessor
    for module in transformer.modules():
        if isinstance(module, Kandinsky6SRAttention) and not isinstance(module.processor, wanted):
            # diffusers' union of processor types leaves out its own Kandinsky 6 SR processor.
            module.set_processor(wanted())  # type: ignore[arg-type]
