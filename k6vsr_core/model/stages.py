"""The model stages of one clip, each a function with tensors in and out (contract §A.3, §C, §D, §E).

    frames of a window --prepare--> padded clip --encode--> LR latent --cut--> LR tiles
    LR tiles of a chunk --denoise (upscaler, seeded noise, DiT steps)--> denoised latents (fp32)
    denoised latent of a tile --decode--> pixel tile --blend--> SR window --resize--> delivery window

Pixels are uint8, as the official pipeline's, or uint16 on the 16-bit path (`ClipPlan.depth`: a 10-bit source to a
10-bit output), which hands the model the same range at finer steps: a 16-bit value v is the 8-bit value v / 257,
so the KVAE sees v / (128 * 257) - 1 where the contract gives it v / 128 - 1, and its output comes back as
65535 / 255 times the contract's, rounded where the contract truncates to 8 bits.

A clip is computed window by window (`k6vsr_core.contract.windows`); every stage here sees one window.

Stages hold no state of their own, so any worker can run any tile; the orchestrated pipeline persists what passes
between them and must get exactly what the in-memory runner gets.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal

import numpy as np
import torch

from k6vsr_core.contract.plan import TEMPORAL_FACTOR, ClipPlan, TileChunk
from k6vsr_core.contract.stage_names import Stage
from k6vsr_core.contract.tiling import SPATIAL_FACTOR, Size
from k6vsr_core.contract.windows import Window
from k6vsr_core.device.precision import dit_for
from k6vsr_core.model import kvae
from k6vsr_core.model.attention import AttentionMode, set_attention
from k6vsr_core.model.bundle import PIFLOW, ModelBundle, diffusers_class
from k6vsr_core.model.pixels import TileBlender, pad_video, pre_upscale_video, resize_video

# Called after every DiT evaluation, e.g. to count them or to report progress.
StepHook = Callable[[int], None]


# The 16-bit path's steps in one step of the contract's 8 bits: 65535 / 255.
DEEP_STEPS = 257
_PIXEL_DTYPES = {8: torch.uint8, 16: torch.uint16}


def frames_to_tensor(frames: np.ndarray) -> torch.Tensor:
    """(T, H, W, 3) uint8 or uint16 frames, as decoded, to a (T, 3, H, W) tensor of their dtype."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype not in (np.uint8, np.uint16):
        raise ValueError(f"frames must be uint8 or uint16 (T, H, W, 3), got {frames.dtype} {frames.shape}")
    return torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)


def tensor_to_frames(video: torch.Tensor) -> np.ndarray:
    """(C, T, H, W) pixels to (T, H, W, C) contiguous frames for the encoder."""
    return np.ascontiguousarray(video.permute(1, 2, 3, 0).numpy())


def prepare_window(frames: np.ndarray, plan: ClipPlan, window: Window) -> torch.Tensor:
    """The clip the KVAE encodes for `window`: its frames padded to 1 + 8k by repeating the last one, pre-upscaled
    for x2.25, padded onto the stride and one tile (T, 3, H, W)."""
    video = frames_to_tensor(frames)
    if video.shape[0] != window.frames or tuple(video.shape[-2:]) != plan.source_size:
        raise ValueError(
            f"frames {tuple(video.shape)} do not match window {window.index} of the plan "
            f"({window.frames}x{plan.source_size})"
        )
    if window.padded > window.frames:
        video = torch.cat([video, video[-1:].expand(window.padded - window.frames, -1, -1, -1)])
    if plan.params.pre_upscale:
        video = pre_upscale_video(video)
    return pad_video(video, plan.grid.padded_size)


def _kvae_chunk(bundle: ModelBundle, stage: Literal[Stage.ENCODE, Stage.DECODE], size: Size, frames: int) -> int | None:
    """Latent frames per KVAE call under the bundle's memory budget; None (the KVAE's own call) without one."""
    return None if bundle.memory is None else bundle.memory.kvae_chunk(stage, size, frames)


@torch.no_grad()
def encode_clip(bundle: ModelBundle, video: torch.Tensor) -> torch.Tensor:
    """KVAE latent of the whole clip, scaled for the upscaler: (1, 64, t, H/16, W/16) float32 on the CPU."""
    with _encoding(bundle, video):
        return scale_latent(bundle, _encode(bundle, video))


@torch.no_grad()
def encode_latent(bundle: ModelBundle, video: torch.Tensor) -> torch.Tensor:
    """The unscaled KVAE latent of a clip as FastVideo's `sr_lr_latent` holds it: (t, 64, H/16, W/16), in the
    KVAE's dtype, on the CPU. `scale_latent` of it is exactly `encode_clip`."""
    with _encoding(bundle, video):
        return _encode(bundle, video)[0].permute(1, 0, 2, 3).contiguous().cpu()


def _encoding(bundle: ModelBundle, video: torch.Tensor) -> AbstractContextManager[None]:
    return bundle.on_gpu(Stage.ENCODE, (video.shape[-2], video.shape[-1]), video.shape[0])


def _encode(bundle: ModelBundle, video: torch.Tensor) -> torch.Tensor:
    vae = bundle.vae
    chunk = _kvae_chunk(bundle, Stage.ENCODE, (video.shape[-2], video.shape[-1]), video.shape[0])
    pixels = to_model_input(video.to(bundle.device).permute(1, 0, 2, 3).unsqueeze(0))
    return kvae.encode(vae, pixels.to(vae.dtype), chunk)


def to_model_input(video: torch.Tensor) -> torch.Tensor:
    """Pixels as the KVAE takes them, float32: the contract's pixels / 128 - 1 (not the usual / 127.5 - 1, which it
    was not trained on), a uint16 pixel first brought to the 8-bit scale (/ 257) without rounding."""
    if video.dtype == torch.uint16:
        return video.float() / (128.0 * DEEP_STEPS) - 1.0
    return video.float() / 128.0 - 1.0


def scale_latent(bundle: ModelBundle, latent: torch.Tensor) -> torch.Tensor:
    """An unscaled KVAE latent, (1, 64, t, h, w) or (t, 64, h, w), scaled for the upscaler: (1, 64, t, h, w) fp32."""
    vae = bundle.vae
    if latent.ndim == 4:
        latent = latent.permute(1, 0, 2, 3).unsqueeze(0)
    latent = latent.to(bundle.device, vae.dtype)
    return (latent * vae.config.scaling_factor).float().cpu()


def cut_tiles(latent: torch.Tensor, plan: ClipPlan, tiles: tuple[int, ...]) -> torch.Tensor:
    """LR latent tiles (n, 64, t, th, tw) of the whole-clip latent, in the given tile order."""
    parts = []
    for index in tiles:
        rows, cols = plan.grid.latent_slices(index)
        parts.append(latent[0, :, :, rows, cols])
    return torch.stack(parts)


def _timesteps(scheduler: object, plan: ClipPlan, device: torch.device) -> torch.Tensor:
    if isinstance(scheduler, diffusers_class(PIFLOW)):
        scheduler.set_timesteps(plan.steps, device=device)
    else:
        # The official flow-Euler schedule: N + 1 points linspace(1, 0), shifted; diffusers' default differs.
        sigmas = np.linspace(1.0, 0.0, plan.steps + 1)[:-1].tolist()
        scheduler.set_timesteps(sigmas=sigmas, device=device)  # type: ignore[attr-defined]
    return scheduler.timesteps  # type: ignore[attr-defined]


def chunk_noise(shape: tuple[int, ...], seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Noise of one chunk: a fresh generator on the compute device seeded `seed`, one draw of (n*t, H, W, C)."""
    n, t, h, w, c = shape
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn((n * t, h, w, c), generator=generator, device=device, dtype=dtype).reshape(shape)


def use_attention(bundle: ModelBundle, mode: AttentionMode, transformer: Any = None) -> None:
    """Switch the DiT (`transformer`, default the bundle's) to `mode`; a bundle prepared by
    `k6vsr_core.model.fast.compile_bundle` then installs its own processors.

    Fast-path hook: the plain path has no `attention_hook` and runs exactly as before.
    """
    transformer = bundle.transformer if transformer is None else transformer
    set_attention(transformer, mode)
    hook = getattr(bundle, "attention_hook", None)
    if hook is not None:
        hook(mode, transformer)


def compile_watch(
    bundle: ModelBundle, component: str, shape: tuple[int, ...], detail: str = ""
) -> AbstractContextManager[None]:
    """Wraps a call of a network the fast path compiles (`k6vsr_core.device.compile_cache.CompileWatch`): the first
    call of
    a shape this machine never compiled says so. The plain path has no watch."""
    watch = getattr(bundle, "compile_watch", None)
    return watch(component, shape, detail) if watch is not None else contextlib.nullcontext()


@torch.no_grad()
def denoise_chunk(
    bundle: ModelBundle,
    lr_tiles: torch.Tensor,
    chunk: TileChunk,
    plan: ClipPlan,
    on_step: StepHook | None = None,
) -> torch.Tensor:
    """Upscale, noise and refine one chunk of LR tiles; returns denoised latents (n, 64, t, H, W) fp32 on the CPU."""
    with bundle.on_gpu(Stage.DENOISE, plan.grid.base, plan.window_frames, tiles=lr_tiles.shape[0]):
        return _denoise(bundle, lr_tiles, chunk, plan, on_step)


def _denoise(
    bundle: ModelBundle, lr_tiles: torch.Tensor, chunk: TileChunk, plan: ClipPlan, on_step: StepHook | None
) -> torch.Tensor:
    device = bundle.device
    dit = dit_for(bundle, plan.params.precision)
    dtype = bundle.transformer.dtype  # the FP8 DiT's inputs and outputs stay bf16
    use_attention(bundle, plan.params.attention, dit)
    upscaled = bundle.latent_upscaler(
        lr_tiles.to(device, bundle.latent_upscaler.dtype), scale=plan.params.tiling_scale, return_dict=False
    )[0]
    lq = upscaled.permute(0, 2, 3, 4, 1).to(dtype)  # the DiT works channels-last (B, T, H, W, C)
    noise = chunk_noise(tuple(lq.shape), chunk.seed, device, dtype)
    scale = bundle.info.lq_noise_scale
    # Variance-preserving mix of the upscaled LR latent and the noise; the running state stays fp32 from here on.
    latents = (math.sqrt(1.0 - scale**2) * lq + scale * noise).float()
    scheduler = bundle.new_scheduler()
    # The released DiT is anchor-free: anchor latent and anchor mask are zeros.
    anchor = torch.zeros((*latents.shape[:-1], latents.shape[-1] + 1), device=device, dtype=dtype)
    for step, timestep in enumerate(_timesteps(scheduler, plan, device)):
        model_input = torch.cat([latents.to(dtype), anchor], dim=-1)
        with compile_watch(bundle, "DiT", tuple(model_input.shape), _dit_detail(plan)):
            prediction = dit(model_input, timestep.float().expand(latents.shape[0]), return_dict=False)[0]
        latents = scheduler.step(prediction.float(), timestep, latents, return_dict=False)[0]
        if on_step is not None:
            on_step(step)
    return latents.permute(0, 4, 1, 2, 3).contiguous().cpu()


def _dit_detail(plan: ClipPlan) -> str:
    """What besides the input's shape makes the DiT another compiled graph."""
    if plan.params.precision == "bf16":
        return plan.params.attention
    return f"{plan.params.attention}, {plan.params.precision}"


def to_pixels(decoded: torch.Tensor, depth: int = 8) -> torch.Tensor:
    """(y + 1) * 128 back to pixels, on the CPU: truncated to uint8 as the official pipeline does, or (`depth` 16)
    rounded to uint16 at 257 steps an 8-bit step."""
    value = ((decoded.float() + 1.0) * 128.0 / 255.0).clamp(0.0, 1.0)
    if depth == 16:
        return (value * 65535.0).round().to(torch.uint16).cpu()
    return (value * 255.0).to(torch.uint8).cpu()


@torch.no_grad()
def decode_tile(bundle: ModelBundle, latent: torch.Tensor, depth: int = 8) -> torch.Tensor:
    """KVAE decode of one denoised tile latent (64, t, H, W) to pixels (3, T, 16H, 16W), `depth` bits a sample
    (`to_pixels`)."""
    vae = bundle.vae
    frames = 1 + (latent.shape[1] - 1) * TEMPORAL_FACTOR
    tile = (latent.shape[2] * SPATIAL_FACTOR, latent.shape[3] * SPATIAL_FACTOR)
    chunk = _kvae_chunk(bundle, Stage.DECODE, tile, frames)
    with bundle.on_gpu(Stage.DECODE, tile, frames):
        z = latent.unsqueeze(0).to(bundle.device) / vae.config.scaling_factor
        # In chunks, each piece becomes pixels on the CPU as it is decoded: the GPU never holds the decoded tile.
        with compile_watch(bundle, "KVAE decoder", tuple(z.shape), f"chunk {chunk}"):
            return kvae.decode(vae, z.to(vae.dtype), chunk, functools.partial(to_pixels, depth=depth))[0]


def blend(plan: ClipPlan, tiles: list[tuple[int, torch.Tensor]], window: Window) -> torch.Tensor:
    """Hann-blend a window's decoded tiles (in tile order) and crop space and time: pixels (3, T, H, W) at source x
    scale, the window's own frames only."""
    blender = window_blender(plan, window)
    for index, tile in sorted(tiles, key=lambda item: item[0]):
        blender.add(index, tile)
    return blended(blender, window)


def window_blender(plan: ClipPlan, window: Window) -> TileBlender:
    """An empty canvas for `window`'s tiles, which may be added as they are decoded, in tile order."""
    return TileBlender(plan.grid, window.padded)


def blended(blender: TileBlender, window: Window) -> torch.Tensor:
    """The canvas once every tile is in, cropped to the window's own frames (see `blend`)."""
    return blender.result()[:, : window.frames]


def deliver(video: torch.Tensor, plan: ClipPlan) -> torch.Tensor:
    """Downscale to the delivery tier, if one was asked for."""
    if tuple(video.shape[-2:]) == plan.delivery_size:
        return video
    return resize_video(video, plan.delivery_size)
