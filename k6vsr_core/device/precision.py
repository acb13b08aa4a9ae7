"""The SR DiT's arithmetic precision: bf16, as released (the contract), or FP8 matrix products, an option.

`fp8` runs the token-wise linear layers of the DiT's blocks (query, key, value and output projections, the
feed-forward's two layers: nearly all of its matrix work) as FP8 products with dynamic per-row scales, through
torchao's `Float8DynamicActivationFloat8WeightConfig` (the `fp8` extra). Everything else stays as released: the
attention, the norms, the per-timestep modulation, the embeddings and the output layer in bf16, the denoise state in
fp32, and the KVAE. It needs an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper), whose tensor cores
multiply FP8; elsewhere it is refused before anything runs. Its outputs differ from bf16's:
bench/network_profile.py measures by how much, next to the compiled path's own difference from the eager one.

The bf16 DiT stays loaded: the FP8 copy is made once per bundle, the first time a request asks for it, so one worker
serves requests of either precision. That copy needs the DiT resident on the GPU (the `fast` memory budget).
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any, Literal

import torch

from k6vsr_core.errors import UserFacingError

Precision = Literal["bf16", "fp8"]
PRECISIONS: tuple[Precision, ...] = ("bf16", "fp8")
FP8_CAPABILITY = (8, 9)
# The blocks' token-wise layers; `visual_modulation` runs once per timestep, on a few rows, where FP8 saves nothing.
FP8_LAYERS = ("self_attention.to_query", "self_attention.to_key", "self_attention.to_value", "self_attention.out_layer",
              "feed_forward.net.0.proj", "feed_forward.net.2")  # fmt: skip


class PrecisionUnavailable(UserFacingError, ValueError):
    """The precision asked for cannot run here (the hardware, the installed packages or the memory budget)."""


def fp8_unavailable(device: torch.device) -> str | None:
    """Why FP8 cannot run on `device`, or None where it can."""
    if device.type != "cuda":
        return f"the model runs on {device.type}, and FP8 needs an NVIDIA GPU of compute capability 8.9 or later"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"{name} has compute capability {capability[0]}.{capability[1]}; FP8 needs 8.9 or later (Ada, Hopper)"
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed: pip install 'k6vsr[fp8]'"
    return None


def check_precision(precision: Precision, device: torch.device) -> None:
    """Refuse `precision` where it cannot run, with the reason; bf16 runs everywhere."""
    if precision == "bf16":
        return
    reason = fp8_unavailable(device)
    if reason is not None:
        raise PrecisionUnavailable(f"precision=fp8 cannot run here: {reason}; use precision=bf16 (the default)")


def fp8_layer(module: torch.nn.Module, name: str) -> bool:
    """Whether the layer called `name` becomes FP8: a linear layer of a DiT block among `FP8_LAYERS`."""
    return (
        isinstance(module, torch.nn.Linear)
        and ".visual_transformer_blocks." in f".{name}"
        and (name.endswith(FP8_LAYERS))
    )


def fp8_transformer(transformer: Any, compiled: bool) -> Any:
    """An FP8 copy of `transformer` (the bf16 one untouched), its blocks compiled like the bf16 ones if `compiled`."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    fp8 = copy.deepcopy(transformer)  # a module's copy drops its compiled wrapper (`Module.__getstate__`)
    quantize_(fp8, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()), filter_fn=fp8_layer)
    if compiled:
        fp8.compile_repeated_blocks(fullgraph=True, dynamic=False)
    return fp8


def dit_for(bundle: Any, precision: Precision) -> Any:
    """The DiT that computes `precision` for `bundle`: its own for bf16, an FP8 copy made once for fp8."""
    if precision == "bf16":
        return bundle.transformer
    check_precision(precision, bundle.device)
    layout = bundle.memory.layout if bundle.memory is not None else None
    if layout is not None and "transformer" in layout.streamed + layout.swapped:
        raise PrecisionUnavailable(
            f"precision=fp8 needs the DiT resident on the GPU; the {bundle.memory.budget} memory budget moves it "
            "between host and GPU: use memory=fast, or precision=bf16"
        )
    variants: dict[str, Any] = bundle.__dict__.setdefault("dit_variants", {})
    if precision not in variants:
        fast_path = getattr(bundle, "fast_path", None)
        variants[precision] = fp8_transformer(bundle.transformer, compiled=bool(fast_path and fast_path.compiled_dit))
    return variants[precision]
