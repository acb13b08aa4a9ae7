"""The released checkpoint's configuration, in its native spelling (contract §H): the one statement of the release.

The bench writes a full-size bundle from it, and the tiny test bundles (`k6vsr_core.bundle.make_tiny_bundle`) are
it at smaller sizes. tests/test_bundle.py states the release again on its own, to check this against.
"""

from __future__ import annotations

from typing import Any

# The released checkpoint on the hub and the revision a run takes by default: here, not in `bundle` (torch,
# safetensors), so that `k6vsr --help` can name the default without importing the model's code.
DEFAULT_MODEL = "kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers"
DEFAULT_REVISION = "3e3e10bcd23659eeeb23cac740258ee4fc14aa7d"
DIFFUSERS_VERSION = "0.41.0.dev0"
SCALING_FACTOR = 0.910344004631042


def released_configs() -> dict[str, dict[str, Any]]:
    """Every config file of the distilled checkpoint: transformer, vae, latent_upscaler, scheduler and the index."""
    dit = {
        "_class_name": "Kandinsky6SRTransformer3DModel",
        "_diffusers_version": DIFFUSERS_VERSION,
        "in_visual_dim": 64,
        "out_visual_dim": 640,
        "time_dim": 512,
        "patch_size": [1, 1, 1],
        "model_dim": 1792,
        "ff_dim": 7168,
        "num_visual_blocks": 32,
        "axes_dims": [16, 24, 24],
        "num_text_blocks": 2,
        "in_text_dim": 3584,
        "in_text_dim2": 768,
        "use_text": False,
        "visual_cond": True,
        "instruct_type": "hybrid_anchor",
        "attribute_overrides": {},
        "attention_params": {
            "512": {"type": "nabla", "P": 0.8, "wT": 11, "wH": 7, "wW": 7, "add_sta": True, "method": "topcdf"},
            "1024": {"type": "flash"},
        },
        "sr_params": {
            "visual_size": [512],
            "scale_factor": {"512": [1, 2, 2]},
            "lq_noise_scale": 0.7,
            "lq_noise_type": "ddpm",
            "lq_channel_noise_scale": 0.0,
            "cap_noise_timestep": False,
            "scheduler_scale": 3.5,
            "fps": 24,
        },
    }
    enc = {
        "ch": 128,
        "ch_mult": [0.125, 1, 2, 4, 8],
        "num_res_blocks": 2,
        "z_channels": 64,
        "double_z": True,
        "temporal_compress_times": 4,
        "temporal_compress_start_level": 1,
        "norm_type": "rms_norm",
        "downsample_version": 2,
        "fix_pxs": True,
    }
    dec = {
        "ch": 256,
        "ch_mult": [0.0625, 1, 2, 4, 8],
        "num_res_blocks": 2,
        "z_channels": 64,
        "temporal_compress_times": 4,
        "temporal_compress_start_level": 1,
        "norm_type": "rms_norm",
    }
    vae = {
        "_class_name": "Kandinsky6SRVAE",
        "_diffusers_version": DIFFUSERS_VERSION,
        "vae_type": "video-kvae",
        "scaling_factor": SCALING_FACTOR,
        "spatial_factor": 16,
        "temporal_factor": 4,
        "encoder_config": enc,
        "decoder_config": dec,
    }
    entry = {
        "multi_scale": True,
        "in_channels": 64,
        "hidden_channels": 2048,
        "stage_channels": [2048, 1024, 512],
        "num_pre_blocks": 5,
        "num_mid_blocks": 3,
        "num_post_blocks": 3,
        "modulated_norm": True,
        "modulated_output_proj": True,
        "bare_stem": True,
        "temporal_padding": "replicate",
        "upsample_mode": "pxs_v2",
        "upsample_padding_mode": "zeros",
    }
    lu = {
        "_class_name": "Kandinsky6SRLatentUpscalerBank",
        "_diffusers_version": DIFFUSERS_VERSION,
        "models": [
            {"target_scale": "4x", "model": dict(entry)},
            {
                "target_scale": "2x",
                "model": {
                    **entry,
                    "enable_x2_entry": True,
                    "x2_adapter_blocks": 2,
                    "x2_adapter_sources": [0, 4],
                    "x2_finisher": "pxs_residual",
                    "x2_tail_mode": "private_full",
                },
            },
        ],
        "scaling_factor": SCALING_FACTOR,
    }
    scheduler = {
        "_class_name": "PiflowScheduler",
        "_diffusers_version": DIFFUSERS_VERSION,
        "num_train_timesteps": 1000,
        "shift": 3.5,
        "n_grid": 10,
        "nfe": 2,
        "eps": 1e-6,
        "final_step_size_scale": 0.5,
        "num_policy_substeps": 128,
    }
    index = {
        "_class_name": "Kandinsky6SRPipeline",
        "_diffusers_version": DIFFUSERS_VERSION,
        "transformer": ["diffusers", "Kandinsky6SRTransformer3DModel"],
        "vae": ["diffusers", "Kandinsky6SRVAE"],
        "latent_upscaler": ["diffusers", "Kandinsky6SRLatentUpscalerBank"],
        "scheduler": ["diffusers", "PiflowScheduler"],
    }
    return {"transformer": dit, "vae": vae, "latent_upscaler": lu, "scheduler": scheduler, "index": index}
