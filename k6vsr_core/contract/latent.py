"""Latent input: an unscaled KVAE latent `[T, C, H, W]` (FastVideo's `sr_lr_latent`) instead of a video.

The latent replaces the encode stage of the one window it holds; everything after it is the video path. So the
latent our own encode stage writes (`stages.encode_latent`) gives exactly the output of the video it came from.
Every check is made before any model work.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from fractions import Fraction
from typing import TYPE_CHECKING

from k6vsr_core.contract.params import UpscaleParams
from k6vsr_core.contract.plan import TEMPORAL_FACTOR, ClipPlan, ModelTraits, make_plan
from k6vsr_core.contract.tiling import SPATIAL_FACTOR
from k6vsr_core.contract.windows import WINDOW_FRAMES
from k6vsr_core.errors import ParameterError

if TYPE_CHECKING:
    import torch

# torch is imported by the functions that touch a tensor: the rules on rates and scales serve planning and the HTTP
# API's checks, which need no tensor.
LATENT_DTYPES = ("float32", "float16", "bfloat16")
# One window: 121 frames are 31 latent frames.
MAX_LATENT_FRAMES = 1 + (WINDOW_FRAMES - 1) // TEMPORAL_FACTOR


def load_latent(path: str | os.PathLike[str]) -> torch.Tensor:
    """The one tensor of a safetensors file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ParameterError(f"latent={path!r}: no such file")
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as err:
        raise ParameterError(f"latent={path!r} is not a readable safetensors file ({err})") from None
    if len(tensors) != 1:
        raise ParameterError(f"latent={path!r} holds {len(tensors)} tensors; give a file of exactly one")
    return next(iter(tensors.values()))


def check_latent(latent: torch.Tensor, channels: int, params: UpscaleParams, fps: object) -> Fraction:
    """Refuse, with one line, a latent the run cannot take; returns the exact frame rate."""
    import torch

    if not isinstance(latent, torch.Tensor):
        raise ParameterError(f"latent must be a torch tensor, got {type(latent).__name__}")
    check_latent_scale(params)
    if latent.ndim != 4:
        raise ParameterError(f"latent shape {tuple(latent.shape)} is not [T, C, H, W]")
    frames, found, height, width = latent.shape
    if str(latent.dtype).removeprefix("torch.") not in LATENT_DTYPES:
        raise ParameterError(f"latent dtype {latent.dtype} is not supported; allowed: float32, float16, bfloat16")
    if found != channels:
        raise ParameterError(f"latent has {found} channels; this model's KVAE latent has {channels} ([T, C, H, W])")
    if not (1 <= frames <= MAX_LATENT_FRAMES and frames % 2 == 1):
        raise ParameterError(
            f"latent has {frames} frames; allowed: an odd count from 1 to {MAX_LATENT_FRAMES} (1 + 8k video frames, "
            "one window)"
        )
    if height < 1 or width < 1:
        raise ParameterError(f"latent shape {tuple(latent.shape)} has an empty side")
    if not bool(torch.isfinite(latent).all()):
        raise ParameterError("latent holds NaN or infinite values")
    return parse_rate(fps)


def check_latent_scale(params: UpscaleParams) -> None:
    if params.pre_upscale:
        raise ParameterError(
            "scale=2.25 cannot start from a latent: it needs the 1.125x pre-upscale of the pixels; use scale 2 or 4"
        )


def parse_rate(fps: object) -> Fraction:
    """A latent's exact frame rate from a number or `a/b` (`24`, `23.976`, `30000/1001`)."""
    try:
        rate = Fraction(str(fps).strip()) if not isinstance(fps, Fraction) else fps
    except (ValueError, ZeroDivisionError):
        raise ParameterError(f"fps={fps!r} is not a number (e.g. 24 or 30000/1001)") from None
    if not 0 < rate <= 1000:
        raise ParameterError(f"fps={fps!r} is out of range; allowed: above 0, at most 1000")
    return rate


def read_latent(
    path: str | os.PathLike[str], channels: int, params: UpscaleParams, fps: object
) -> tuple[torch.Tensor, Fraction]:
    """The latent of a safetensors file, checked (`check_latent`), and its exact frame rate."""
    latent = load_latent(path)
    return latent, check_latent(latent, channels, params, fps)


def latent_params(params: UpscaleParams) -> UpscaleParams:
    """The request as a latent run computes it: every frame kept at the latent's rate, silent unless an audio file is
    given (a latent has no streams of its own to carry), and in even windows (it has no frames to find cuts in)."""
    audio = params.audio if params.audio_file is not None else "none"
    return params.model_copy(update={"fps_mode": "source", "audio": audio, "windows": "even"})


def latent_clip(latent: torch.Tensor | Sequence[int]) -> tuple[int, tuple[int, int]]:
    """The frame count and (H, W) pixel size of the clip a latent (the tensor, or its `[T, C, H, W]` shape) holds."""
    shape = tuple(latent.shape) if hasattr(latent, "shape") else tuple(latent)
    return 1 + TEMPORAL_FACTOR * (shape[0] - 1), (shape[2] * SPATIAL_FACTOR, shape[3] * SPATIAL_FACTOR)


def plan_latent(
    latent: torch.Tensor | Sequence[int], rate: Fraction, params: UpscaleParams, traits: ModelTraits
) -> ClipPlan:
    """The plan of a latent's clip (the tensor, or its `[T, C, H, W]` shape): `1 + 4(T - 1)` frames of `16H x 16W`
    pixels at `rate`, every one kept, for the request as a latent run computes it (`latent_params`)."""
    frames, size = latent_clip(latent)
    with warnings.catch_warnings():
        # The rate is the caller's: no frame is dropped or added, whatever it is.
        warnings.simplefilter("ignore")
        return make_plan(size, frames, float(rate), latent_params(params), traits, rate)


def fit_latent(latent: torch.Tensor, plan: ClipPlan) -> torch.Tensor:
    """A scaled (1, C, t, h, w) latent padded bottom/right onto the plan's tile grid, as the video path pads the
    pixels (reflect, or replicate where the strip is too long). A latent already on the grid is unchanged."""
    import torch.nn.functional as F

    height = plan.grid.padded_size[0] // SPATIAL_FACTOR
    width = plan.grid.padded_size[1] // SPATIAL_FACTOR
    bottom, right = height - latent.shape[-2], width - latent.shape[-1]
    if bottom == 0 and right == 0:
        return latent
    mode = "reflect" if bottom < latent.shape[-2] and right < latent.shape[-1] else "replicate"
    # 2-D reflection pads 4-D tensors: fold time into the channels and back.
    n, c, t, h, w = latent.shape
    padded = F.pad(latent.reshape(n, c * t, h, w), (0, right, 0, bottom), mode=mode)
    return padded.reshape(n, c, t, h + bottom, w + right)
