"""k6vsr_core: the Kandinsky 6.0 VSR model contract as pure functions on tensors and media.

No Prefect and no Zarr here: this package is the only place that knows the model, and the in-memory runner
`upscale` is the reference that the orchestrated pipeline must match byte for byte.
"""

from k6vsr_core.bundle import DEFAULT_MODEL, DEFAULT_REVISION, BundleError, ModelBundle, load_bundle, make_tiny_bundle
from k6vsr_core.params import ParameterError, UpscaleParams, parse_params
from k6vsr_core.plan import ClipPlan, ModelTraits, make_plan
from k6vsr_core.runner import UpscaleResult, upscale

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
