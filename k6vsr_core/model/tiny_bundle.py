"""Tiny random bundles in exactly the released layout and native config spelling: what the tests, the benchmarks and
the demo run on a CPU. The released configs (`k6vsr_core.contract.release_config`) at small sizes, random weights."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k6vsr_core.model.bundle import (
    FLOW_EULER,
    MODEL_INDEX,
    WEIGHTS,
    diffusers_class,
    latent_upscaler_kwargs,
    transformer_kwargs,
    vae_kwargs,
)

if TYPE_CHECKING:
    import torch

TINY_TILE_SIZES = ((128, 128), (128, 256), (256, 128))


def make_tiny_bundle(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    distilled: bool = True,
    tile_sizes: tuple[tuple[int, int], ...] = TINY_TILE_SIZES,
    head_width: int | None = None,
) -> Path:
    """Write a tiny random bundle in exactly the released layout and native config spelling.

    Random weights: the output is noise-like, but every stage runs as with the real model. `tile_sizes` must keep
    each latent tile side a multiple of 8 (NABLA's block grid) at both scales. `head_width` overrides the DiT output
    width, to build deliberately inconsistent bundles.
    """
    import torch

    root = Path(path)
    configs = tiny_configs(distilled, tile_sizes, head_width)
    generator = torch.Generator().manual_seed(seed)
    builders = {"transformer": transformer_kwargs, "vae": vae_kwargs, "latent_upscaler": latent_upscaler_kwargs}
    for component, kwargs_of in builders.items():
        _write_random_component(
            root / component, component, kwargs_of(configs[component]), configs[component], generator
        )
    (root / "scheduler").mkdir(parents=True, exist_ok=True)
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(configs["scheduler"], indent=2))
    (root / MODEL_INDEX).write_text(json.dumps(configs["index"], indent=2))
    return root


# The tiny bundle's sizes, put over the released configs (k6vsr_core.contract.release_config).
TINY_DIT_SIZES = {"time_dim": 32, "model_dim": 64, "ff_dim": 128, "num_visual_blocks": 2, "axes_dims": [4, 6, 6]}
TINY_VAE_SIZES = {
    "in_channels": 3,
    "out_channels": 3,
    "ch": 8,
    "ch_mult": [1, 1, 1, 1, 1],
    "decoder_ch": 8,
    "decoder_ch_mult": [1, 1, 1, 1, 1],
    "num_res_blocks": 1,
    "resolution": 256,
    "z_channels": 64,
    "double_z": True,
    "temporal_compress_times": 4,
    "temporal_compress_start_level": 1,
    "fix_pxs": True,
    "norm_type": "rms_norm",
    "downsample_version": 2,
    "padding_mode": "replicate",
}
# The tiny upscaler bank leaves out the release's later options (output projection, bare stem, x2 finisher): its
# layout, and with it the weights a seed gives and every test's reference output, stay as they were.
TINY_LU_ENTRY = {
    "multi_scale": True,
    "in_channels": 64,
    "hidden_channels": 32,
    "stage_channels": [32, 16, 16],
    "num_pre_blocks": 1,
    "num_mid_blocks": 1,
    "num_post_blocks": 1,
    "modulated_norm": True,
    "temporal_padding": "replicate",
    "upsample_mode": "pxs_v2",
}
# The undistilled checkpoint's sampler: flow matching with Euler steps.
FLOW_EULER_SCHEDULER = {
    "_class_name": FLOW_EULER,
    "_diffusers_version": "0.39.0",
    "num_train_timesteps": 1000,
    "shift": 5.0,
    "use_dynamic_shifting": False,
}


def tiny_configs(
    distilled: bool = True, tile_sizes: tuple[tuple[int, int], ...] = TINY_TILE_SIZES, head_width: int | None = None
) -> dict[str, dict[str, Any]]:
    """The config files of a tiny bundle: the released ones at the tiny sizes (see `make_tiny_bundle`)."""
    from k6vsr_core.contract.release_config import released_configs

    release = released_configs()
    dit = release["transformer"]
    transformer = {
        **dit,
        "out_visual_dim": head_width if head_width is not None else (640 if distilled else 64),
        **TINY_DIT_SIZES,
        "sr_params": {**dit["sr_params"], "scheduler_scale": 3.5 if distilled else 5.0},
        # Not in the released file (whose tiles are the class default); the tiny bundle trains on smaller tiles.
        "tile_sizes": [list(hw) for hw in tile_sizes],
    }
    nested = ("encoder_config", "decoder_config")
    vae = {**{key: value for key, value in release["vae"].items() if key not in nested}, **TINY_VAE_SIZES}
    x2_entry = {**TINY_LU_ENTRY, "enable_x2_entry": True, "x2_adapter_blocks": 1, "x2_adapter_sources": [0, 1]}
    upscaler = {
        **release["latent_upscaler"],
        "models": [{"target_scale": "4x", "model": dict(TINY_LU_ENTRY)}, {"target_scale": "2x", "model": x2_entry}],
    }
    scheduler = release["scheduler"] if distilled else FLOW_EULER_SCHEDULER
    index = {**release["index"], "scheduler": ["diffusers", scheduler["_class_name"]]}
    return {"transformer": transformer, "vae": vae, "latent_upscaler": upscaler, "scheduler": scheduler, "index": index}


def _write_random_component(
    folder: Path, component: str, kwargs: dict[str, Any], config: dict[str, Any], generator: torch.Generator
) -> None:
    """One component with deterministic, well-scaled random weights: fan-in scaling keeps activations finite
    through the nets, norm gains start near 1."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    module = diffusers_class(component)(**kwargs)
    state = {}
    for name, tensor in module.state_dict().items():
        fan_in = max(1, tensor[0].numel()) if tensor.ndim > 1 else 1
        scale = 1.0 / fan_in**0.5 if tensor.ndim > 1 else 0.02
        values = torch.randn(tensor.shape, generator=generator) * scale
        if name.endswith("weight") and tensor.ndim == 1:
            values = values + 1.0  # norm gains
        state[name] = values.contiguous()
    save_file(state, str(folder / WEIGHTS))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
