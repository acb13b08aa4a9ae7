"""The GPU fast path: compiled DiT blocks, the fastest attention kernels, a compiled KVAE decoder.

`compile_bundle(bundle)` prepares a loaded bundle in place; every stage function then runs faster with the same
contract. It is what every entry point does with a model on CUDA (`--no-compile` keeps the networks eager). What it
changes, on a CUDA device:

- DiT: `compile_repeated_blocks(fullgraph=True, dynamic=False)` (one graph shared by the 32 blocks, per tile shape).
- Attention: dense mode calls cuDNN's fused attention (the fastest kernel at the tile shape on Hopper) when a
  probe on the device passes, else SDPA's default choice; NABLA mode calls flex attention with explicit kernel
  options (`BLOCK_M = BLOCK_N = 64`, 4 warps, 3 stages), which torch 2.11 needs to compile NABLA's 64-token blocks.
  Flex attention is always compiled: inside the compiled blocks, or on its own when the blocks stay eager
  (`compiled=False`). Run eagerly, PyTorch's flex attention materialises the whole attention matrix, 236 GiB at a
  W1 tile (1 x 28 heads x 47,616 tokens): diffusers' own processor does that uncompiled.
- Inductor's deterministic mode (no kernel choice by on-device timing), so worker processes compile the same
  kernels: set for the whole process when the bundle is loaded (`k6vsr_core.device.determinism`), reported here.
  Measured on two H200s (bench/RESULTS.md): DiT latents are bit-identical across workers, KVAE-decoded pixels were
  not (tiles decoded in another process differed by up to 13 levels), at a time when a one-thread worker decoded
  another number of latent frames per call than the command (`k6vsr_core.model.memory` no longer lets them differ).
- KVAE decoder: its spatial norms and causal convolutions in their fast forms (`k6vsr_core.model.fast_decoder`: the same
  function with fewer passes over memory), then `torch.compile(dynamic=False)`, with Inductor's caches (FX graph,
  AOT autograd, Triton kernels) kept in a per-user folder, so the long first compile is paid once per machine rather
  than once per process.

Models already run in bf16 on CUDA (`load_bundle`), and the denoise state stays fp32 as the contract asks. Where
the weights live is the memory budget's business (`k6vsr_core.model.memory`), which works with or without this.

On a CPU nothing is compiled and the attention processors fall back to the plain ones, so outputs are bit-identical
to the plain path. On a GPU, compiled kernels round differently from eager ones, so the fast path's frames are not
bit-equal to the plain path's; with random weights those rounding differences grow through the network (the
benchmark measured 31 dB PSNR between them on W2), so only real weights can say how close they are in practice.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRAttnProcessor, nabla_block_mask
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from k6vsr_core.device.compile_cache import (
    COMPILE_ESTIMATES,
    CompileWatch,
    compile_cache_dir,
    enable_compile_cache,
    import_configured_artifacts,
)
from k6vsr_core.model.attention import AttentionMode, DenseSdpaProcessor, project_qkv
from k6vsr_core.model.bundle import ModelBundle
from k6vsr_core.model.fast_decoder import channels_last_wanted, fuse_decoder

# Flex attention tile sizes must divide NABLA's 64-token blocks; 4 warps and 3 stages were the fastest measured on
# an H200 at the STA-floor density (performance-baseline.md).
FLEX_KERNEL_OPTIONS: dict[str, int] = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
DYNAMO_RECOMPILE_LIMIT = 64


def _raise_recompile_limit() -> None:
    """Each tile shape and attention mode is one more graph of the same block code; the default limit is 8."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name) and getattr(config, name) < DYNAMO_RECOMPILE_LIMIT:
            setattr(config, name, DYNAMO_RECOMPILE_LIMIT)


def _deterministic_inductor() -> bool:
    """Whether Inductor runs in its deterministic mode (`k6vsr_core.device.determinism` sets it when a bundle loads)."""
    from torch._inductor import config as inductor_config

    return bool(getattr(inductor_config, "deterministic", False))


# ---------------------------------------------------------------------------------------------------- attention


def _cudnn_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """cuDNN's fused attention on (B, heads, S, D) inputs; the same function as SDPA, another kernel.

    The aten op, not the public `sdpa_kernel(SDPBackend.CUDNN_ATTENTION)` around SDPA: that one picks its kernel by
    the tensors' device, so the CPU test of this path's memory (`tests/model/test_attention_memory.py`, fake tensors)
    could not run it, and on CUDA it dispatches to this same op."""
    return torch.ops.aten._scaled_dot_product_cudnn_attention(query, key, value, None, False, 0.0, False, False)[0]


def cudnn_attention_works(device: torch.device) -> bool:
    """Whether cuDNN attention runs on `device` and agrees with the math kernel (a small eager probe, no compile)."""
    if device.type != "cuda":
        return False
    try:
        generator = torch.Generator(device=device).manual_seed(0)
        q, k, v = (
            torch.randn((1, 256, 4, 64), device=device, dtype=torch.bfloat16, generator=generator).transpose(1, 2)
            for _ in range(3)
        )
        out = _cudnn_attention(q, k, v).float()
        ref = torch.softmax((q.float() @ k.float().transpose(-2, -1)) / 8.0, dim=-1) @ v.float()
        return bool(((out - ref).norm() / ref.norm()).item() < 2e-2)
    except Exception:  # noqa: BLE001 - any failure means: use the default SDPA dispatch
        return False


class FastDenseProcessor(DenseSdpaProcessor):
    """Dense attention through cuDNN's fused kernel on CUDA where it works; elsewhere exactly the plain processor.

    Same projections, norms and rotary arithmetic as `DenseSdpaProcessor`; only the attention kernel is chosen
    explicitly (cuDNN measured 474 TFLOP/s at the tile shape on an H200, flash 319). `compile_bundle` sets
    `use_cudnn` after probing the device.
    """

    # Off CUDA the plain processor runs (bit-identical); tests lift that to check the CUDA path's memory on the CPU.
    cuda_only = True

    def __init__(self, use_cudnn: bool = False) -> None:
        self.use_cudnn = use_cudnn

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if self.use_cudnn and (query.is_cuda or not self.cuda_only):
            return _cudnn_attention(query, key, value)
        return super().attend(query, key, value)


def fixed_density_block_mask(
    query: torch.Tensor, key: torch.Tensor, sta: torch.Tensor, density: float, block_size: int = 64
) -> BlockMask:
    """NABLA's block mask with a fixed share of blocks per query block, for the benchmark's real-weights projection.

    NABLA keeps, per query block, the key blocks that hold `threshold` of its pooled attention mass, plus the STA
    prior. Random weights spread that mass evenly and keep about 84 % of the blocks; trained weights concentrate it.
    This keeps the `ceil(density * blocks)` strongest blocks of each row by the same pooled map (so the kernel sees
    the same block pattern shape as NABLA's), plus the STA prior: at least `density`, more where the prior adds.
    """
    if not 0.0 < density <= 1.0:
        raise ValueError(f"a block density must be in (0, 1], not {density}")
    batch, heads, tokens, dim = query.shape
    blocks = tokens // block_size
    pooled_q = query.reshape(batch, heads, blocks, block_size, dim).mean(-2)
    pooled_k = key.reshape(batch, heads, blocks, block_size, dim).mean(-2).transpose(-2, -1)
    scores = (pooled_q @ pooled_k) / math.sqrt(dim)
    keep = math.ceil(density * blocks)
    strongest = scores.topk(keep, dim=-1).indices
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, strongest, True)
    mask = torch.logical_or(mask, sta)
    counts = mask.sum(-1).to(torch.int32)
    indices = mask.to(torch.int8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)
    return BlockMask.from_kv_blocks(
        torch.zeros_like(counts), indices, counts, indices, BLOCK_SIZE=block_size, mask_mod=None
    )


class FastNablaProcessor(Kandinsky6SRAttnProcessor):
    """The NABLA processor of the fast path (a subclass of diffusers' own, so `set_attention` keeps it).

    diffusers' NABLA arithmetic with explicit flex kernel options on CUDA; the plain processor elsewhere.

    `threshold` overrides the model's `nabla_threshold` (the benchmark's STA-floor run sets 0: only the STA
    prior and the single strongest block per row are kept); `density`, where set, replaces NABLA's threshold rule
    by `fixed_density_block_mask` (the benchmark's projection of trained weights' sparsity). `stats`, a float64
    CUDA tensor of two elements, accumulates (kept block pairs, all block pairs) over every call, to report the
    density actually used.
    """

    # Off CUDA the plain processor runs (bit-identical); tests lift that to check the CUDA path's memory on the CPU.
    cuda_only = True

    def __init__(
        self,
        threshold: float | None = None,
        stats: torch.Tensor | None = None,
        flex: Callable[..., torch.Tensor] = flex_attention,
    ) -> None:
        self.threshold = threshold
        self.density: float | None = None
        self.stats = stats
        # Plain `flex_attention` when the blocks around it are compiled (it is traced into their graph), else
        # `compiled_flex_attention()`: never the eager one, which builds the whole attention matrix.
        self.flex = flex

    def __call__(
        self, attn: Any, hidden_states: torch.Tensor, rotary_emb: torch.Tensor, sparse_params: dict[str, Any]
    ) -> torch.Tensor:
        if self.cuda_only and not hidden_states.is_cuda:
            return super().__call__(attn, hidden_states, rotary_emb, sparse_params)
        query, key, value = project_qkv(attn, hidden_states, rotary_emb)
        if self.density is not None:
            block_mask = fixed_density_block_mask(query, key, sparse_params["sta_mask"], self.density)
        else:
            threshold = sparse_params["threshold"] if self.threshold is None else self.threshold
            block_mask = nabla_block_mask(query, key, sparse_params["sta_mask"], thr=threshold)
        if self.stats is not None:
            # diffusers files every kept block as a full block (its partial counts are zeros); count both.
            kept = block_mask.kv_num_blocks.sum().to(torch.float64)
            if block_mask.full_kv_num_blocks is not None:
                kept = kept + block_mask.full_kv_num_blocks.sum().to(torch.float64)
            total = block_mask.kv_num_blocks.numel() * block_mask.kv_indices.shape[-1]
            self.stats.add_(torch.stack([kept, torch.full_like(kept, total)]))
        options = dict(FLEX_KERNEL_OPTIONS) if hidden_states.is_cuda else None
        if options is None:  # Inductor's CPU flex template wants contiguous inputs
            query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        out = self.flex(query, key, value, block_mask=block_mask, kernel_options=options)
        return attn.out_layer(out.transpose(1, 2).flatten(2, 3))


@functools.cache
def compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """Flex attention compiled on its own (PyTorch's documented way to run it outside a compiled model): a fused
    kernel that never holds the attention matrix. One per process, so each tile shape compiles once."""
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


def fast_processor(mode: AttentionMode, *, compiled_blocks: bool, use_cudnn: bool) -> Any:
    """The processor the fast path gives each attention layer for `mode` (on CUDA; the plain one runs elsewhere)."""
    if mode == "dense":
        return FastDenseProcessor(use_cudnn)
    # Inside compiled blocks, the plain function (the block's compile fuses it); else one compiled on its own.
    flex: Callable[..., torch.Tensor] = flex_attention
    if not compiled_blocks:
        flex = compiled_flex_attention()
    return FastNablaProcessor(flex=flex)


def _attention_modules(transformer: Any) -> list[Any]:
    from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRAttention

    return [module for module in transformer.modules() if isinstance(module, Kandinsky6SRAttention)]


class AttentionSwitch:
    """Installs the fast processors for a mode, reusing one processor object per layer and mode.

    `stages.denoise_chunk` calls it after the plain `set_attention`. Reusing the same objects matters under
    `torch.compile`: the compiled blocks are guarded on the processor they were traced with, so fresh objects on
    every switch would mean a recompile on every switch.
    """

    def __init__(self, transformer: Any, *, compiled_blocks: bool, use_cudnn: bool = False) -> None:
        self.transformer = transformer
        self.compiled_blocks = compiled_blocks
        self.use_cudnn = use_cudnn
        # Per DiT (the bf16 one, and an FP8 copy if a request asks for one: k6vsr_core.device.precision), per mode.
        self._processors: dict[int, dict[str, list[Any]]] = {}

    def processors_of(self, transformer: Any) -> dict[str, list[Any]]:
        known = self._processors.get(id(transformer))
        if known is None:
            modules = _attention_modules(transformer)
            known = {
                mode: [
                    fast_processor(mode, compiled_blocks=self.compiled_blocks, use_cudnn=self.use_cudnn)
                    for _ in modules
                ]  # fmt: skip
                for mode in ("dense", "nabla")
            }
            self._processors[id(transformer)] = known
        return known

    @property
    def processors(self) -> dict[str, list[Any]]:
        return self.processors_of(self.transformer)

    def __call__(self, mode: AttentionMode, transformer: Any = None) -> None:
        transformer = self.transformer if transformer is None else transformer
        processors = self.processors_of(transformer)[mode]
        for module, processor in zip(_attention_modules(transformer), processors, strict=True):
            if module.processor is not processor:
                module.set_processor(processor)

    def nabla_settings(
        self, threshold: float | None = None, stats: torch.Tensor | None = None, density: float | None = None
    ) -> None:
        """Set the NABLA threshold override, a fixed block density and the density accumulator on every layer
        (benchmark use)."""
        for processor in self.processors["nabla"]:
            processor.threshold = threshold
            processor.density = density
            processor.stats = stats


# ---------------------------------------------------------------------------------------------------- entry point


@dataclass
class FastPath:
    """What `compile_bundle` did to a bundle (kept on it as `bundle.fast_path`)."""

    device: str
    compiled_dit: bool = False
    compiled_decoder: bool = False
    compiled_flex: bool = False
    fused_decoder: int = 0  # decoder modules in their fast forms (k6vsr_core.model.fast_decoder)
    cache_dir: str | None = None
    cudnn_attention: bool = False
    deterministic: bool = False
    flex_kernel_options: dict[str, int] = field(default_factory=lambda: dict(FLEX_KERNEL_OPTIONS))
    notes: list[str] = field(default_factory=list)


def compile_bundle(
    bundle: ModelBundle,
    *,
    compiled: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    on_cpu: bool = False,
    fuse: bool = True,
) -> FastPath:
    """Prepare `bundle` in place for fast inference; returns what was done. Idempotent.

    On CUDA: the fast attention processors always (NABLA's flex attention compiled on its own when the blocks are
    not), and with `compiled` the DiT blocks and the KVAE decoder compiled too; `deterministic` in the answer says
    whether Inductor may choose kernels by timing them (`k6vsr_core.device.determinism`, set when the bundle loads). On
    a CPU
    this compiles nothing (unless `on_cpu`, for experiments) and leaves the arithmetic untouched, so outputs stay
    bit-identical. `fuse` gives the KVAE decoder its fast forms (`k6vsr_core.model.fast_decoder`) where the path
    applies;
    off only to measure them.
    """
    existing = getattr(bundle, "fast_path", None)
    if existing is not None:
        return existing
    device = bundle.device
    cuda = device.type == "cuda"
    path = FastPath(device=str(device))
    if cuda or on_cpu:
        import_configured_artifacts()
        root = Path(cache_dir) if cache_dir is not None else compile_cache_dir()
        enable_compile_cache(root)
        path.cache_dir = str(root)
        _raise_recompile_limit()
        path.deterministic = _deterministic_inductor()
    path.cudnn_attention = cudnn_attention_works(device) if cuda else False
    compile_networks = compiled and (cuda or on_cpu)
    if path.cache_dir is not None:
        # What compiles at a new shape: everything, or NABLA's flex attention alone (`stages` calls the watch).
        if compile_networks:
            watch = CompileWatch(root, {("DiT", None), ("KVAE decoder", None)}, COMPILE_ESTIMATES["networks"])
        else:
            watch = CompileWatch(root, {("DiT", "nabla")}, COMPILE_ESTIMATES["flex attention"])
        bundle.compile_watch = watch  # type: ignore[attr-defined]
    path.compiled_flex = cuda and not compile_networks
    switch = AttentionSwitch(bundle.transformer, compiled_blocks=compile_networks, use_cudnn=path.cudnn_attention)
    # The hook `stages.denoise_chunk` calls after the plain `set_attention` (see stages.use_attention).
    bundle.attention_hook = switch  # type: ignore[attr-defined]
    if fuse and (cuda or on_cpu):
        # Channels-last only compiled: eager, the norms and upsamplings between the convolutions ran slower in that
        # layout on an H200 (performance-baseline.md), and compiled they are one generated kernel each.
        channels_last = compile_networks and channels_last_wanted()
        path.fused_decoder = fuse_decoder(bundle.vae.decoder, channels_last=channels_last)
    if compile_networks:
        bundle.transformer.compile_repeated_blocks(fullgraph=True, dynamic=False)
        # Graph breaks are allowed: the decoder's Python-side segment bookkeeping stays eager where it must.
        bundle.vae.decoder.compile(dynamic=False)
        path.compiled_dit = path.compiled_decoder = True
    if not cuda:
        path.notes.append("CPU: nothing compiled; processors fall back to the plain arithmetic")
    bundle.fast_path = path  # type: ignore[attr-defined]
    return path
