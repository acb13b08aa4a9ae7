"""The released checkpoint's configuration, in its native spelling (contract §H): the one statement of the release.

Its config files are data, `released/`, laid out as on the hub (`model_index.json`, `transformer/config.json`, ...).
The bench writes a full-size bundle from them, and the tiny test bundles
(`k6vsr_core.model.tiny_bundle.make_tiny_bundle`) are
them at smaller sizes. tests/model/test_bundle.py states the release again on its own, to check them against.
"""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any

# The released checkpoint on the hub and the revision a run takes by default: here, not in `bundle` (torch,
# safetensors), so that `k6vsr --help` can name the default without importing the model's code.
DEFAULT_MODEL = "kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers"
DEFAULT_REVISION = "3e3e10bcd23659eeeb23cac740258ee4fc14aa7d"
DIFFUSERS_VERSION = "0.41.0.dev0"


# Where each config file lies in the released layout, under `released/` beside this module (package data).
RELEASED_FILES = {
    "transformer": "transformer/config.json",
    "vae": "vae/config.json",
    "latent_upscaler": "latent_upscaler/config.json",
    "scheduler": "scheduler/scheduler_config.json",
    "index": "model_index.json",
}


def released_configs() -> dict[str, dict[str, Any]]:
    """Every config file of the distilled checkpoint: transformer, vae, latent_upscaler, scheduler and the index."""
    folder = files("k6vsr_core") / "released"
    configs = {}
    for name, relative in RELEASED_FILES.items():
        config = json.loads(folder.joinpath(*relative.split("/")).read_text())
        if config.get("_diffusers_version") != DIFFUSERS_VERSION:
            raise ValueError(f"released/{relative}: written by diffusers {config.get('_diffusers_version')}")
        configs[name] = config
    return configs
