"""Tests for k6vsr_core.model.bundle: loading tiny bundles, their identity, and every refusal with its own message."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k6vsr_core.model.bundle import (
    DEFAULT_MODEL,
    WEIGHTS,
    BundleError,
    ModelBundle,
    fingerprint,
    latent_upscaler_kwargs,
    load_bundle,
    transformer_kwargs,
    vae_kwargs,
)
from k6vsr_core.model.tiny_bundle import TINY_TILE_SIZES, make_tiny_bundle


def _copy(source: Path, tmp_path: Path, name: str = "copy") -> Path:
    target = tmp_path / name
    shutil.copytree(source, target)
    return target


def _defaults(cls: type) -> dict[str, object]:
    return {
        name: p.default
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


# --------------------------------------------------------------------------------------------------- loading


def test_tiny_bundle_loads(tiny_bundle: ModelBundle, tiny_bundle_path: Path) -> None:
    from diffusers import (
        Kandinsky6SRLatentUpscalerBank,
        Kandinsky6SRTransformer3DModel,
        Kandinsky6SRVAE,
        PiflowScheduler,
    )

    assert isinstance(tiny_bundle.transformer, Kandinsky6SRTransformer3DModel)
    assert isinstance(tiny_bundle.vae, Kandinsky6SRVAE)
    assert isinstance(tiny_bundle.latent_upscaler, Kandinsky6SRLatentUpscalerBank)
    assert isinstance(tiny_bundle.scheduler, PiflowScheduler)
    info = tiny_bundle.info
    assert info.scheduler == "PiflowScheduler"
    assert info.lq_noise_scale == 0.7
    assert info.tile_sizes == TINY_TILE_SIZES
    assert info.revision is None
    assert info.model_id == f"local:{info.fingerprint}"
    assert info.path == str(tiny_bundle_path.resolve())
    assert tiny_bundle.device == torch.device("cpu")
    # The native config was translated: the tiny sizes, not the released class defaults, were built.
    assert tiny_bundle.transformer.config.model_dim == 64
    assert tuple(tiny_bundle.vae.config.encoder_block_out_channels) == (8, 8, 8, 8, 8)
    assert tiny_bundle.transformer.dtype == torch.float32
    assert not any(p.requires_grad for p in tiny_bundle.transformer.parameters())


def test_piflow_scheduler_uses_the_bundle_shift(tiny_bundle: ModelBundle) -> None:
    from diffusers import PiflowScheduler

    assert PiflowScheduler().config.shift == 5.0  # the class default the contract warns about
    assert tiny_bundle.scheduler.config.shift == 3.5
    assert tiny_bundle.scheduler.config.n_grid == 10
    assert tiny_bundle.info.trained_steps == 2
    fresh = tiny_bundle.new_scheduler()
    assert fresh is not tiny_bundle.scheduler and isinstance(fresh, PiflowScheduler)
    assert fresh.config.shift == 3.5
    # 2 evaluations, shift 3.5: raw (1, 1/3) -> sigma (1, 7/11) -> timesteps (1000, 636.36).
    fresh.set_timesteps(2)
    torch.testing.assert_close(fresh.timesteps.double(), torch.tensor([1000.0, 7000 / 11], dtype=torch.float64))


def test_nfe_sets_trained_steps(tiny_bundle_path: Path, tmp_path: Path) -> None:
    path = _copy(tiny_bundle_path, tmp_path)
    config_file = path / "scheduler" / "scheduler_config.json"
    config = json.loads(config_file.read_text())
    config["nfe"] = 3
    config_file.write_text(json.dumps(config))
    assert load_bundle(str(path)).info.trained_steps == 3


def test_flow_bundle(flow_bundle: ModelBundle) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    assert isinstance(flow_bundle.scheduler, FlowMatchEulerDiscreteScheduler)
    assert flow_bundle.info.scheduler == "FlowMatchEulerDiscreteScheduler"
    assert flow_bundle.info.trained_steps == 4
    assert flow_bundle.scheduler.config.shift == 5.0
    assert flow_bundle.transformer.config.out_visual_dim == 64


# --------------------------------------------------------------------------------------------------- identity


def test_identity_is_stable_across_loads(tiny_bundle: ModelBundle, tiny_bundle_path: Path) -> None:
    again = load_bundle(str(tiny_bundle_path))
    assert again.info.identity == tiny_bundle.info.identity
    assert again.info.fingerprint == tiny_bundle.info.fingerprint
    assert tiny_bundle.info.identity == f"local:{tiny_bundle.info.fingerprint}@{tiny_bundle.info.fingerprint}"


def test_renamed_folder_keeps_its_identity(tiny_bundle: ModelBundle, tiny_bundle_path: Path, tmp_path: Path) -> None:
    renamed = _copy(tiny_bundle_path, tmp_path, "some-other-name")
    info = load_bundle(str(renamed)).info
    assert info.path != tiny_bundle.info.path
    assert info.fingerprint == tiny_bundle.info.fingerprint
    assert info.identity == tiny_bundle.info.identity


def test_explicit_model_id_is_used(tiny_bundle: ModelBundle, tiny_bundle_path: Path) -> None:
    info = load_bundle(str(tiny_bundle_path), model_id="acme/k6-sr").info
    assert info.model_id == "acme/k6-sr"
    assert info.identity == f"acme/k6-sr@{tiny_bundle.info.fingerprint}"


def test_config_change_changes_identity(tiny_bundle: ModelBundle, tiny_bundle_path: Path, tmp_path: Path) -> None:
    path = _copy(tiny_bundle_path, tmp_path)
    config_file = path / "scheduler" / "scheduler_config.json"
    config = json.loads(config_file.read_text())
    config["shift"] = 3.0
    config_file.write_text(json.dumps(config))
    assert fingerprint(path) != tiny_bundle.info.fingerprint


def test_new_weights_change_identity(tiny_bundle: ModelBundle, tiny_bundle_path: Path, tmp_path: Path) -> None:
    path = _copy(tiny_bundle_path, tmp_path)
    weights = path / "latent_upscaler" / WEIGHTS
    state = load_file(str(weights))
    name = sorted(state)[0]
    state[name] = state[name] + 1.0
    save_file(state, str(weights))
    assert fingerprint(path) != tiny_bundle.info.fingerprint


# --------------------------------------------------------------------------------------------------- refusals


def test_piflow_with_64_wide_head_is_refused(tmp_path: Path) -> None:
    path = make_tiny_bundle(tmp_path / "b", head_width=64)
    with pytest.raises(BundleError, match=r"^transformer: a PiFlow scheduler needs a 640-wide head") as caught:
        load_bundle(str(path))
    assert "has 64" in str(caught.value)


def test_flow_euler_with_640_head_points_to_the_distilled_model(tmp_path: Path) -> None:
    path = make_tiny_bundle(tmp_path / "b", distilled=False, head_width=640)
    with pytest.raises(BundleError, match=r"^transformer: ") as caught:
        load_bundle(str(path))
    message = str(caught.value)
    assert "FlowMatchEulerDiscreteScheduler" in message
    assert "Use the distilled model" in message
    assert DEFAULT_MODEL in message


def test_missing_component_folder(tiny_bundle_path: Path, tmp_path: Path) -> None:
    path = _copy(tiny_bundle_path, tmp_path)
    shutil.rmtree(path / "vae")
    with pytest.raises(BundleError, match=r"^vae: component folder .*vae is missing"):
        load_bundle(str(path))


def test_missing_weights_file(tiny_bundle_path: Path, tmp_path: Path) -> None:
    path = _copy(tiny_bundle_path, tmp_path)
    (path / "transformer" / WEIGHTS).unlink()
    with pytest.raises(BundleError, match=rf"^transformer: .*{WEIGHTS} is missing"):
        load_bundle(str(path))


def test_missing_config(tiny_bundle_path: Path, tmp_path: Path) -> None:
    path = _copy(tiny_bundle_path, tmp_path)
    (path / "latent_upscaler" / "config.json").unlink()
    with pytest.raises(BundleError, match=r"^latent_upscaler: .*config.json is missing"):
        load_bundle(str(path))


def test_missing_model_index(tiny_bundle_path: Path, tmp_path: Path) -> None:
    path = _copy(tiny_bundle_path, tmp_path)
    (path / "model_index.json").unlink()
    with pytest.raises(BundleError, match=r"^model_index: .*model_index.json is missing"):
        load_bundle(str(path))


def test_pickled_weights_are_refused(tiny_bundle_path: Path, tmp_path: Path) -> None:
    path = _copy(tiny_bundle_path, tmp_path)
    torch.save({"weight": torch.zeros(2)}, path / "transformer" / "pytorch_model.bin")
    with pytest.raises(BundleError, match=r"^transformer: refusing pickled weights \['pytorch_model.bin'\]"):
        load_bundle(str(path))


def test_latent_upscaler_weights_missing_a_tensor(tiny_bundle_path: Path, tmp_path: Path) -> None:
    path = _copy(tiny_bundle_path, tmp_path)
    weights = path / "latent_upscaler" / WEIGHTS
    state = load_file(str(weights))
    dropped = sorted(state)[-1]
    del state[dropped]
    save_file(state, str(weights))
    with pytest.raises(BundleError, match=r"^latent_upscaler: weights do not match") as caught:
        load_bundle(str(path))
    assert "1 missing" in str(caught.value)
    assert dropped in str(caught.value)


def test_latent_upscaler_weights_of_another_shape(tiny_bundle_path: Path, tmp_path: Path) -> None:
    path = _copy(tiny_bundle_path, tmp_path)
    weights = path / "latent_upscaler" / WEIGHTS
    state = load_file(str(weights))
    name = next(n for n in sorted(state) if state[n].ndim > 1)
    shape = tuple(state[name].shape)
    state[name] = torch.zeros((shape[0] + 1, *shape[1:]))
    save_file(state, str(weights))
    with pytest.raises(BundleError, match=r"^latent_upscaler: weights do not match") as caught:
        load_bundle(str(path))
    assert "of another shape" in str(caught.value)
    assert name in str(caught.value)


def test_upscale_refuses_weights_that_do_not_match_before_it_runs(
    tiny_bundle_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without warm workers the command computes, and checks the weights itself before any flow starts."""
    from entrypoints.cli import main
    from k6vsr_core.media.sample import make_sample_clip

    monkeypatch.setenv("K6VSR_WARM_WORKERS", "off")
    path = _copy(tiny_bundle_path, tmp_path)
    weights = path / "vae" / WEIGHTS
    state = load_file(str(weights))
    del state[sorted(state)[-1]]
    save_file(state, str(weights))
    clip = make_sample_clip(tmp_path / "clip.mp4", width=64, height=64, num_frames=1)
    argv = ["upscale", str(clip), "--scale", "2", "--model", str(path), "--device", "cpu"]
    rc = main([*argv, "--store", str(tmp_path / "store"), "-o", str(tmp_path / "out")])
    assert rc != 0 and "vae: weights do not match the architecture" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_unexpected_tensor_is_refused(tiny_bundle_path: Path, tmp_path: Path) -> None:
    path = _copy(tiny_bundle_path, tmp_path)
    weights = path / "vae" / WEIGHTS
    state = load_file(str(weights))
    state["extra.weight"] = torch.zeros(1)
    save_file(state, str(weights))
    with pytest.raises(BundleError, match=r"^vae: weights do not match.*unexpected \(e\.g\. extra\.weight\)"):
        load_bundle(str(path))


def test_unknown_scheduler_is_refused(tiny_bundle_path: Path, tmp_path: Path) -> None:
    path = _copy(tiny_bundle_path, tmp_path)
    config_file = path / "scheduler" / "scheduler_config.json"
    config = json.loads(config_file.read_text())
    config["_class_name"] = "DDIMScheduler"
    config_file.write_text(json.dumps(config))
    with pytest.raises(BundleError, match=r"^scheduler: unsupported scheduler class 'DDIMScheduler'"):
        load_bundle(str(path))


def test_missing_local_folder(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="does not exist"):
        load_bundle(str(tmp_path / "nowhere"))


def test_uncached_hub_id_offline_says_how_to_use_a_local_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.chdir(tmp_path)
    model = "k6vsr-tests/not-a-cached-repo"
    with pytest.raises(BundleError) as caught:
        load_bundle(model, revision="0123456789abcdef0123456789abcdef01234567")
    message = str(caught.value)
    assert model in message
    assert "local Hugging Face cache" in message
    assert f"hf download {model}" in message
    assert "--model DIR" in message
    assert f"--model-id {model}" in message


# --------------------------------------------------------------------------------------------------- native configs

RELEASED_VAE = {
    "vae_type": "video-kvae",
    "scaling_factor": 0.910344004631042,
    "spatial_factor": 16,
    "temporal_factor": 4,
    "encoder_config": {
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
    },
    "decoder_config": {"ch": 256, "ch_mult": [0.0625, 1, 2, 4, 8], "num_res_blocks": 2, "z_channels": 64},
}


def test_vae_kwargs_nested_released_form() -> None:
    from diffusers import Kandinsky6SRVAE

    kwargs = vae_kwargs(RELEASED_VAE)
    assert kwargs == {
        "latent_channels": 64,
        "encoder_block_out_channels": (16, 128, 256, 512, 1024),
        "decoder_block_out_channels": (16, 256, 512, 1024, 2048),
        "layers_per_block": 2,
        "temporal_compression_ratio": 4,
        "temporal_compression_start_level": 1,
        "scaling_factor": 0.910344004631042,
    }
    # Contract §H: the diffusers defaults are the released architecture.
    defaults = _defaults(Kandinsky6SRVAE)
    assert all(defaults[name] == value for name, value in kwargs.items())


def test_vae_kwargs_flat_and_diffusers_forms() -> None:
    flat = {
        **RELEASED_VAE["encoder_config"],
        "decoder_ch": 256,
        "decoder_ch_mult": [0.0625, 1, 2, 4, 8],
        "scaling_factor": 0.9,
    }
    kwargs = vae_kwargs(flat)
    assert kwargs["encoder_block_out_channels"] == (16, 128, 256, 512, 1024)
    assert kwargs["decoder_block_out_channels"] == (16, 256, 512, 1024, 2048)
    assert kwargs["scaling_factor"] == 0.9
    native = {"_class_name": "Kandinsky6SRVAE", "encoder_block_out_channels": [8, 8], "latent_channels": 64}
    assert vae_kwargs(native) == {"encoder_block_out_channels": [8, 8], "latent_channels": 64}
    with pytest.raises(KeyError):
        vae_kwargs({"scaling_factor": 1.0})


def test_bundle_with_nested_vae_config_loads(tiny_bundle_path: Path, tmp_path: Path) -> None:
    path = _copy(tiny_bundle_path, tmp_path)
    config_file = path / "vae" / "config.json"
    flat = json.loads(config_file.read_text())
    nested = {
        "_class_name": flat["_class_name"],
        "vae_type": "video-kvae",
        "scaling_factor": flat["scaling_factor"],
        "encoder_config": {
            key: flat[key]
            for key in (
                "ch",
                "ch_mult",
                "num_res_blocks",
                "z_channels",
                "temporal_compress_times",
                "temporal_compress_start_level",
            )
        },
        "decoder_config": {"ch": flat["decoder_ch"], "ch_mult": flat["decoder_ch_mult"]},
    }
    config_file.write_text(json.dumps(nested))
    bundle = load_bundle(str(path))
    assert tuple(bundle.vae.config.encoder_block_out_channels) == (8, 8, 8, 8, 8)
    assert tuple(bundle.vae.config.decoder_block_out_channels) == (8, 8, 8, 8, 8)


def test_bundle_with_unreadable_vae_config(tiny_bundle_path: Path, tmp_path: Path) -> None:
    path = _copy(tiny_bundle_path, tmp_path)
    (path / "vae" / "config.json").write_text(json.dumps({"scaling_factor": 1.0}))
    with pytest.raises(BundleError, match=r"^vae: config.json cannot be read"):
        load_bundle(str(path))


RELEASED_LU_ENTRY = {
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
RELEASED_LU_2X = {
    **RELEASED_LU_ENTRY,
    "enable_x2_entry": True,
    "x2_adapter_blocks": 2,
    "x2_adapter_sources": [0, 4],
    "x2_finisher": "pxs_residual",
    "x2_tail_mode": "private_full",
}


def test_latent_upscaler_kwargs_released_models_list() -> None:
    from diffusers import Kandinsky6SRLatentUpscalerBank

    config = {"models": [RELEASED_LU_ENTRY, RELEASED_LU_2X], "scaling_factor": 0.910344004631042}
    kwargs = latent_upscaler_kwargs(config)
    assert kwargs == {
        "in_channels": 64,
        "stage_channels": (2048, 1024, 512),
        "num_pre_blocks": 5,
        "num_mid_blocks": 3,
        "num_post_blocks": 3,
        "num_x2_adapter_blocks": 2,
        "scales": (2, 4),
        "scaling_factor": 0.910344004631042,
    }
    defaults = _defaults(Kandinsky6SRLatentUpscalerBank)
    assert all(defaults[name] == value for name, value in kwargs.items())


def test_latent_upscaler_kwargs_wrapped_entries_any_order() -> None:
    small = {**RELEASED_LU_ENTRY, "stage_channels": [32, 16, 16], "num_pre_blocks": 1}
    config = {
        "models": [
            {"target_scale": "2x", "model": {**small, "enable_x2_entry": True, "x2_adapter_blocks": 1}},
            {"target_scale": "4x", "model": small},
        ]
    }
    kwargs = latent_upscaler_kwargs(config)
    assert kwargs["stage_channels"] == (32, 16, 16)
    assert kwargs["num_pre_blocks"] == 1
    assert kwargs["num_x2_adapter_blocks"] == 1
    assert "scaling_factor" not in kwargs
    with pytest.raises(KeyError):
        latent_upscaler_kwargs({"models": [RELEASED_LU_ENTRY]})


RELEASED_DIT = {
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
        "lq_channel_noise_scale": 0,
        "cap_noise_timestep": False,
        "scheduler_scale": 3.5,
        "fps": 24,
    },
}


def test_transformer_kwargs_released_config() -> None:
    from diffusers import Kandinsky6SRTransformer3DModel

    kwargs = transformer_kwargs(RELEASED_DIT)
    assert kwargs == {
        "in_visual_dim": 64,
        "out_visual_dim": 640,
        "time_dim": 512,
        "model_dim": 1792,
        "ff_dim": 7168,
        "num_visual_blocks": 32,
        "patch_size": (1, 1, 1),
        "axes_dims": (16, 24, 24),
        "scale_factor": (1.0, 2.0, 2.0),
        "nabla_threshold": 0.8,
        "nabla_window": (11, 7, 7),
    }
    defaults = _defaults(Kandinsky6SRTransformer3DModel)
    assert all(defaults[name] == value for name, value in kwargs.items())


def test_transformer_kwargs_reads_attention_and_sr_params() -> None:
    config = {
        **RELEASED_DIT,
        "attention_params": {"512": {"type": "nabla", "P": 0.7, "wT": 5, "wH": 3, "wW": 9}},
        "sr_params": {"scale_factor": {"512": [1, 3, 3]}},
    }
    kwargs = transformer_kwargs(config)
    assert kwargs["nabla_threshold"] == 0.7
    assert kwargs["nabla_window"] == (5, 3, 9)
    assert kwargs["scale_factor"] == (1.0, 3.0, 3.0)
    # Diffusers-spelled keys win over the native ones.
    explicit = transformer_kwargs({**config, "nabla_threshold": 0.9, "scale_factor": [1, 4, 4]})
    assert explicit["nabla_threshold"] == 0.9
    assert explicit["scale_factor"] == (1, 4, 4)
    # A non-NABLA attention entry contributes nothing.
    dense = transformer_kwargs({**RELEASED_DIT, "attention_params": {"512": {"type": "flash"}}})
    assert "nabla_threshold" not in dense and "nabla_window" not in dense


def test_hub_repo_id_loads_from_the_local_hugging_face_cache(
    tiny_bundle_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The repo-id path of the loader, fed from a cache laid out as huggingface_hub writes it."""
    import shutil

    from huggingface_hub import constants

    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "models--acme--tiny-vsr" / "snapshots" / revision
    shutil.copytree(tiny_bundle_path, snapshot)
    (tmp_path / "models--acme--tiny-vsr" / "refs").mkdir()
    (tmp_path / "models--acme--tiny-vsr" / "refs" / "main").write_text(revision)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    bundle = load_bundle("acme/tiny-vsr", revision)
    assert bundle.info.model_id == "acme/tiny-vsr"
    assert bundle.info.identity == f"acme/tiny-vsr@{revision}"
    assert Path(bundle.info.path) == snapshot


def test_released_transformer_config_without_tile_sizes_uses_the_trained_tiles(
    tiny_bundle_path: Path, tmp_path: Path
) -> None:
    """The released transformer/config.json has no `tile_sizes`: the class default (the release's) applies."""
    from k6vsr_core.contract.tiling import RESOLUTIONS
    from k6vsr_core.model.bundle import inspect_bundle

    path = _copy(tiny_bundle_path, tmp_path)
    config_file = path / "transformer" / "config.json"
    config = json.loads(config_file.read_text())
    del config["tile_sizes"]
    config_file.write_text(json.dumps(config))
    assert inspect_bundle(path).info.tile_sizes == RESOLUTIONS


def test_plan_defaults_are_the_diffusers_classes_defaults() -> None:
    """A plan reads the defaults the released configs omit from k6vsr's constants, so that it imports no diffusers:
    they must be the classes' own (read through the signature: diffusers wraps `__init__`)."""
    from diffusers import Kandinsky6SRTransformer3DModel, Kandinsky6SRVAE

    from k6vsr_core.contract.tiling import RESOLUTIONS
    from k6vsr_core.model.bundle import DEFAULT_LATENT_CHANNELS

    def default(cls: type, name: str) -> object:
        return inspect.signature(cls.__init__).parameters[name].default

    assert tuple(map(tuple, default(Kandinsky6SRTransformer3DModel, "tile_sizes"))) == RESOLUTIONS
    assert default(Kandinsky6SRVAE, "latent_channels") == DEFAULT_LATENT_CHANNELS


def test_a_plan_without_the_tensor_check_imports_no_torch(tiny_bundle_path: Path, tmp_path: Path) -> None:
    """What a client of warm workers does before its first task (plan, ingest) imports neither torch nor diffusers,
    and plans the run the full check plans: same model, same run key."""
    import os
    import sys

    import procs

    from k6vsr_core.contract.params import parse_params
    from k6vsr_core.media.sample import make_sample_clip
    from service.runs import ModelSpec, prepare_run

    clip = make_sample_clip(tmp_path / "clip.mp4", width=64, height=64, num_frames=1)
    spec = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    checked = prepare_run(clip, parse_params(scale=2), spec, tmp_path / "store")
    code = (
        "import sys\n"
        "from k6vsr_core.contract.params import parse_params\n"
        "from service.runs import ModelSpec, prepare_run\n"
        "from tasks.ingest import ingest\n"
        f"spec = ModelSpec(model={str(tiny_bundle_path)!r}, device='cpu')\n"
        f"prepared = prepare_run({str(clip)!r}, parse_params(scale=2), spec, {str(tmp_path / 'store')!r}, "
        "tensors=False)\n"
        "ingest.fn(prepared, 'attempt')\n"
        "print(prepared.model_dump_json())\n"
        "print(sorted(m for m in ('torch', 'diffusers') if m in sys.modules))\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = procs.run([sys.executable, "-c", code], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    planned, imported = done.stdout.strip().splitlines()[-2:]
    assert imported == "[]"
    assert json.loads(planned) == json.loads(checked.model_dump_json())


def test_the_model_is_checked_once_per_content(
    tiny_bundle_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two clips planned with one bundle (an archive, the HTTP server): the weights are hashed and checked against
    the architecture for the first only; new weights are hashed and checked again."""
    from k6vsr_core.contract.params import parse_params
    from k6vsr_core.media.sample import make_sample_clip
    from k6vsr_core.model import bundle as bundle_module
    from service.runs import ModelSpec, prepare_run

    path = _copy(tiny_bundle_path, tmp_path)  # a folder no earlier test has checked
    counts = {"hashed": 0, "checked": 0}

    def counted(name: str, real: object) -> object:
        def call(*args: object, **kwargs: object) -> object:
            counts[name] += 1
            return real(*args, **kwargs)  # type: ignore[operator]

        return call

    monkeypatch.setattr(bundle_module, "_hash_bundle", counted("hashed", bundle_module._hash_bundle))
    monkeypatch.setattr(bundle_module, "_check_tensors", counted("checked", bundle_module._check_tensors))
    spec, params = ModelSpec(model=str(path), device="cpu"), parse_params(scale=2)
    clips = [make_sample_clip(tmp_path / f"{n}.mp4", width=64, height=64, num_frames=n) for n in (1, 9)]
    first, second = (prepare_run(clip, params, spec, tmp_path / "store") for clip in clips)
    assert counts == {"hashed": 1, "checked": 3}
    assert first.model_info == second.model_info

    weights = path / "latent_upscaler" / WEIGHTS
    state = load_file(str(weights))
    name = sorted(state)[0]
    state[name] = state[name] + 1.0
    weights.unlink()  # a new file, as a download or a copy writes it
    save_file(state, str(weights))
    again = prepare_run(clips[0], params, spec, tmp_path / "store")
    assert counts == {"hashed": 2, "checked": 6}
    assert again.model_info.fingerprint != first.model_info.fingerprint


def test_the_release_config_states_the_release_as_this_file_does() -> None:
    """k6vsr_core.contract.release_config, which the bench and the tiny bundles build on, against this file's own
    statement
    of the released checkpoint."""
    from k6vsr_core.contract.release_config import released_configs

    release = released_configs()
    private = ("_class_name", "_diffusers_version")
    assert {k: v for k, v in release["transformer"].items() if k not in private} == RELEASED_DIT
    assert transformer_kwargs(release["transformer"]) == transformer_kwargs(RELEASED_DIT)
    assert vae_kwargs(release["vae"]) == vae_kwargs(RELEASED_VAE)
    by_scale = {entry["target_scale"]: entry["model"] for entry in release["latent_upscaler"]["models"]}
    assert by_scale == {"4x": RELEASED_LU_ENTRY, "2x": RELEASED_LU_2X}
    assert release["scheduler"]["_class_name"] == "PiflowScheduler" and release["scheduler"]["nfe"] == 2
    assert release["index"]["scheduler"] == ["diffusers", "PiflowScheduler"]
