"""k6vsr_core: the Kandinsky 6.0 VSR model contract as pure functions on tensors and media.

No Prefect and no Zarr here: this package is the only place that knows the model, and the in-memory runner
`upscale` is the reference that the orchestrated pipeline must match byte for byte.

The names below are imported on first use (PEP 562): `bundle` and `runner` load torch and diffusers, which take
seconds, and a command that only parses its flags or plans a run imports `k6vsr_core.errors` or `params` alone.

Importing it sets the environment every process that computes needs before torch reads it
(`k6vsr_core.device.process_env`): the first of k6vsr's modules any process imports, before anything asks for Inductor's
cache folder or starts CUDA. It also keeps diffusers from importing torchao, which only `precision=fp8` needs
(`k6vsr_core.device.torchao_gate`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k6vsr_core.device.process_env import compute_defaults
from k6vsr_core.device.torchao_gate import hide_torchao_from_diffusers
from k6vsr_core.lazy import lazy_attributes

compute_defaults()
hide_torchao_from_diffusers()

if TYPE_CHECKING:
    from k6vsr_core.contract.params import ParameterError, UpscaleParams, parse_params
    from k6vsr_core.contract.plan import ClipPlan, ModelTraits, make_plan
    from k6vsr_core.model.bundle import DEFAULT_MODEL, DEFAULT_REVISION, BundleError, ModelBundle, load_bundle
    from k6vsr_core.model.runner import UpscaleResult, upscale
    from k6vsr_core.model.tiny_bundle import make_tiny_bundle

_HOMES = {
    "DEFAULT_MODEL": "model.bundle",
    "DEFAULT_REVISION": "model.bundle",
    "BundleError": "errors",
    "ModelBundle": "model.bundle",
    "load_bundle": "model.bundle",
    "make_tiny_bundle": "model.tiny_bundle",
    "ParameterError": "errors",
    "UpscaleParams": "contract.params",
    "parse_params": "contract.params",
    "ClipPlan": "contract.plan",
    "ModelTraits": "contract.plan",
    "make_plan": "contract.plan",
    "UpscaleResult": "model.runner",
    "upscale": "model.runner",
}

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_REVISION",
    "BundleError",
    "ClipPlan",
    "ModelBundle",
    "ModelTraits",
    "ParameterError",
    "UpscaleParams",
    "UpscaleResult",
    "load_bundle",
    "make_plan",
    "make_tiny_bundle",
    "parse_params",
    "upscale",
]


__getattr__ = lazy_attributes(__name__, _HOMES)
