"""The request: every knob a caller may turn, validated once at the boundary.

Everything downstream (geometry, seeding, the run key) trusts these values, so each invalid one is refused here with
a message that names the field, the value and what is allowed, before any file is read or any model is loaded.
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from k6vsr_core.contract.windows import MAX_OVERLAP
from k6vsr_core.errors import ParameterError
from k6vsr_core.media.encoding import VideoEncoding, check_encoding

SCALES = (2.0, 2.25, 4.0)
TARGET_TIERS = ("hd", "fullhd", "2k")
AUDIO_MODES = ("contract", "original", "none")
FPS_MODES = ("contract", "source")  # the words of `fps_mode` (UpscaleParams)
_WXH = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")
# A larger delivery size is certainly a typo: the biggest tier is 2560 px and the model output tops out near 8K.
MAX_TARGET_SIDE = 16384


class UpscaleParams(BaseModel):
    """One upscale request. Defaults are the official ones (contract §A-F)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Each field's description is its help, on the command line (`entrypoints.flags`) and in Prefect's UI.
    scale: float = Field(2.25, description="2, 2.25 or 4")
    # None means "what the checkpoint was trained for": 2 PiFlow evaluations, or 4 flow-Euler steps.
    num_inference_steps: int | None = Field(None, description="DiT evaluations per tile (default: the checkpoint's)")
    tiles_batch_size: int = Field(1, description="tiles denoised together")
    min_overlap: float = Field(0.2, description="minimum tile overlap")
    seed: int = Field(42, description="noise seed")
    target_resolution: str | None = Field(None, description="none, hd, fullhd, 2k or WxH (default none)")
    target_resize_mode: Literal["fit", "exact"] = Field("fit", description="fit or exact")
    attention: Literal["nabla", "dense"] = Field("nabla", description="nabla or dense (nabla as released)")
    # `bf16`: the contract; `fp8`: the DiT's matrix products in FP8 on GPUs that have them
    # (k6vsr_core.device.precision).
    precision: Literal["bf16", "fp8"] = Field(
        "bf16",
        description="bf16 or fp8 (the DiT's matrix products in FP8; Ada/Hopper GPUs, the fp8 extra; bf16 as released)",
    )
    # `all`: every kept frame, in overlapping windows; `contract`: the official first 121 frames
    # (k6vsr_core.contract.windows).
    frames: Literal["all", "contract"] = Field(
        "all", description="all (every kept frame, in 121-frame windows) or contract (the first 121)"
    )
    max_frames: int | None = Field(None, description="with frames all: only the first N kept frames (a preview)")
    window_overlap: int = Field(16, description="frames shared by neighbouring windows, at least")
    # `even`: windows spread evenly over the clip; `scenes`: within each shot, none across a scene cut.
    windows: Literal["even", "scenes"] = Field(
        "scenes",
        description="scenes (windows within each shot, none across a scene cut; the source is decoded once more to "
        "find them) or even (windows spread over the clip, cuts or not)",
    )
    # Output controls (k6vsr_core.media.encoding): the defaults write the contract's file, byte for byte.
    codec: str = Field(
        "h264",
        description="h264, hevc, ffv1 (lossless, in .mkv), prores (422 HQ or 4444, in .mov), dnxhr (HQX, in .mov) "
        "or av1 (10-bit)",
    )
    crf: int | None = Field(
        None, description="h264/hevc quality, 0 (best) to 51 (default 18); av1: 0 to 63 (default 30)"
    )
    preset: str | None = Field(
        None,
        description="h264/hevc speed preset, ultrafast to placebo (default: the encoder's, medium); av1: 0 to 13",
    )
    pix_fmt: str | None = Field(
        None,
        description="yuv420p, yuv420p10le, yuv444p or yuv444p10le (default yuv420p, yuv420p10le for a 10-bit "
        "source; ffv1: lossless RGB, yuv444p10le for a 10-bit source, or gbrp10le); prores: yuv422p10le (422 HQ, "
        "default), yuv444p10le or yuva444p10le (4444); dnxhr: yuv422p10le; av1: yuv420p10le",
    )
    # `contract`: the first audio stream as mono 44.1 kHz AAC; `original`: every audio and subtitle stream of the
    # source as it is (trimmed), with its metadata; `none`: video only; otherwise the path of an audio file, mixed
    # to the contract's format.
    audio: str = Field(
        "contract",
        description="contract (mono 44.1 kHz AAC), original (every audio and subtitle stream as is), none, or an "
        "audio file to mix in",
    )
    # `auto`: an interlaced source (its stream's flags, or combing in its picture) is deinterlaced by bwdif, one frame
    # per frame, before the model sees it; `bwdif`: every source is; `off`: none is (k6vsr_core.media.fields).
    deinterlace: Literal["auto", "off", "bwdif"] = Field(
        "auto",
        description="auto (interlaced sources, found by their flags or their combing, deinterlaced by bwdif), off, "
        "or bwdif (always)",
    )
    # `contract`: the 24-fps rule; `source`: every source frame at the source's exact (rational) rate.
    fps_mode: Literal["contract", "source"] = Field(
        "contract",
        description="contract (the 24-fps rule) or source (every frame at the exact source rate; out of contract)",
    )

    @field_validator("scale", mode="before")
    @classmethod
    def _scale(cls, value: object) -> float:
        try:
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"scale={value!r} is not a number; allowed: 2, 2.25 or 4") from None
        if number not in SCALES:
            raise ValueError(f"scale={value!r} is not supported; allowed: 2, 2.25 or 4")
        return number

    @field_validator("num_inference_steps")
    @classmethod
    def _steps(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= 100:
            raise ValueError(f"num_inference_steps={value} is out of range; allowed: 1 to 100 (or unset)")
        return value

    @field_validator("tiles_batch_size")
    @classmethod
    def _batch(cls, value: int) -> int:
        if not 1 <= value <= 64:
            raise ValueError(f"tiles_batch_size={value} is out of range; allowed: 1 to 64")
        return value

    @field_validator("min_overlap")
    @classmethod
    def _overlap(cls, value: float) -> float:
        if not 0.0 <= value < 1.0 or value != value:
            raise ValueError(f"min_overlap={value} is out of range; allowed: 0 <= min_overlap < 1")
        return value

    @field_validator("max_frames")
    @classmethod
    def _max_frames(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"max_frames={value} is out of range; allowed: 1 or more (or unset for every frame)")
        return value

    @field_validator("window_overlap")
    @classmethod
    def _window_overlap(cls, value: int) -> int:
        if not 0 <= value <= MAX_OVERLAP:
            raise ValueError(f"window_overlap={value} is out of range; allowed: 0 to {MAX_OVERLAP} frames")
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int) -> int:
        if not 0 <= value < 2**63 - 1024:
            raise ValueError(f"seed={value} is out of range; allowed: 0 to 2**63 - 1025")
        return value

    @field_validator("target_resolution", mode="before")
    @classmethod
    def _target(cls, value: object) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str):
            raise ValueError(f"target_resolution={value!r} must be a string; allowed: none, hd, fullhd, 2k or WxH")
        key = value.strip().lower()
        if key in ("", "none"):
            return None
        if key in TARGET_TIERS:
            return key
        match = _WXH.match(key)
        if not match:
            raise ValueError(f"target_resolution={value!r} is not known; allowed: none, hd, fullhd, 2k or WxH")
        width, height = int(match.group(1)), int(match.group(2))
        if not (2 <= width <= MAX_TARGET_SIDE and 2 <= height <= MAX_TARGET_SIDE):
            raise ValueError(
                f"target_resolution={value!r} is out of range; allowed: each side 2 to {MAX_TARGET_SIDE} pixels"
            )
        return f"{width}x{height}"

    @field_validator("audio", mode="before")
    @classmethod
    def _audio(cls, value: object) -> str:
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"audio={value!r} is not known; allowed: contract, original, none or an audio file path")
        if value.strip() in AUDIO_MODES:
            return value.strip()
        path = os.path.abspath(os.path.expanduser(value))
        if not os.path.isfile(path):
            raise ValueError(
                f"audio={value!r} is neither contract, original nor none, and is not an existing audio file"
            )
        return path

    @model_validator(mode="after")
    def _encoding(self) -> UpscaleParams:
        problems = check_encoding(self.codec, self.crf, self.preset, self.pix_fmt)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _contract_has_no_cap(self) -> UpscaleParams:
        if self.frames == "contract" and self.max_frames is not None:
            raise ValueError(
                f"max_frames={self.max_frames} applies to frames='all' only; frames='contract' keeps the first "
                "121 frames, floored to 1 + 8k"
            )
        return self

    @property
    def encoding(self) -> VideoEncoding:
        return VideoEncoding(codec=self.codec, crf=self.crf, preset=self.preset, pix_fmt=self.pix_fmt)  # type: ignore[arg-type]

    @property
    def audio_file(self) -> str | None:
        """The separate audio file asked for, if any."""
        return None if self.audio in AUDIO_MODES else self.audio

    @property
    def tiling_scale(self) -> int:
        """The latent upscaler's factor: 2.25 runs the x2 path after a 1.125 pre-upscale."""
        return 4 if self.scale == 4.0 else 2

    @property
    def pre_upscale(self) -> bool:
        return self.scale == 2.25

    @property
    def scale_label(self) -> str:
        """`2`, `2.25` or `4`, as users write it."""
        return f"{self.scale:g}"


def output_name(source: str | os.PathLike[str], params: UpscaleParams, stamped_at: datetime | None = None) -> str:
    """`<stem>_sr<scale>x.mp4`, the name SGLang users know (`.mkv` for FFV1), `_<timestamp>` before the suffix when
    `stamped_at` is given: a command's reruns write new files, an archive's find the outputs of earlier ones."""
    stamp = f"_{stamped_at.strftime('%Y%m%d-%H%M%S')}" if stamped_at is not None else ""
    return f"{Path(source).stem}_sr{params.scale_label}x{stamp}{params.encoding.suffix}"


def parse_params(**values: object) -> UpscaleParams:
    """Build an `UpscaleParams`, turning pydantic's report into one `ParameterError` per request."""
    try:
        return UpscaleParams(**values)  # type: ignore[arg-type]
    except ValidationError as err:
        messages = []
        for problem in err.errors():
            field = ".".join(str(part) for part in problem["loc"]) or "request"
            text = problem["msg"].removeprefix("Value error, ")
            # A check across fields (loc empty) names its own fields.
            if problem["loc"] and not text.startswith(field):
                text = f"{field}={problem.get('input')!r}: {text}"
            messages.append(text)
        raise ParameterError("; ".join(messages)) from None
