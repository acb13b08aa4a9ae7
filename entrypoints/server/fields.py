"""A request's fields: SGLang's names for the upscale parameters, checked one by one, and a latent's rate."""

from __future__ import annotations

from typing import Any

from entrypoints.server.api_errors import ApiError
from entrypoints.server.confine import quote
from k6vsr_core.contract.latent import parse_rate
from k6vsr_core.contract.params import ParameterError, UpscaleParams, parse_params

# SGLang request field -> UpscaleParams field.
FIELDS = {
    "sr_resolution_scale": "scale",
    "sr_tiles_batch_size": "tiles_batch_size",
    "sr_tile_min_overlap": "min_overlap",
    "sr_target_resolution": "target_resolution",
    "sr_target_resize_mode": "target_resize_mode",
    "seed": "seed",
    "num_inference_steps": "num_inference_steps",
    # Whole videos: absent fields mean every frame, so an SGLang client gets the whole video.
    "sr_frames": "frames",
    "max_frames": "max_frames",
    "sr_window_overlap": "window_overlap",
    "sr_windows": "windows",
    # Output controls, as the command line's --codec, --crf, --preset, --pix-fmt, --audio and --fps.
    "codec": "codec",
    "crf": "crf",
    "preset": "preset",
    "pix_fmt": "pix_fmt",
    "audio": "audio",
    "fps_mode": "fps_mode",
    "deinterlace": "deinterlace",
}
# A client names no file of the server's: `audio` takes the modes only, not a path.
HTTP_AUDIO_MODES = ("contract", "original", "none")
# Sent by OpenAI-style clients; meaningless for super-resolution, so accepted and ignored.
IGNORED_FIELDS = ("model", "prompt")
FILE_FIELD = "video_reference"
# Instead of a clip: one unscaled KVAE latent [T, C, H, W] (a safetensors file), played at the rate of `RATE_FIELD`.
LATENT_FIELD = "latent_reference"
RATE_FIELD = "fps"
FILE_FIELDS = (FILE_FIELD, LATENT_FIELD)
# At most this many of a request's field problems are spelled out in one message.
PROBLEMS_SHOWN = 3


def params_from_fields(fields: dict[str, Any]) -> UpscaleParams:
    """SGLang fields -> UpscaleParams; every bad value is reported with its SGLang field name."""
    values: dict[str, Any] = {}
    problems: list[tuple[str, str, str]] = []  # (field, message, code)
    for name, value in fields.items():
        if name in IGNORED_FIELDS:
            continue
        internal = FIELDS.get(name)
        if internal is None:
            allowed = ", ".join(["video_path", *FILE_FIELDS, RATE_FIELD, *FIELDS])
            problems.append((name, f"unknown field {quote(name)}; allowed: {allowed}", "unknown_field"))
            continue
        if isinstance(value, bool) or isinstance(value, (list, dict)):
            problems.append((name, f"{name}={quote(str(value))} has the wrong type", "invalid_value"))
            continue
        if name == "audio" and value not in HTTP_AUDIO_MODES:
            allowed = ", ".join(HTTP_AUDIO_MODES)
            problems.append((name, f"audio={quote(str(value))} is not known; allowed: {allowed}", "invalid_value"))
            continue
        try:
            parse_params(**{internal: value})
        except ParameterError as err:
            text = " ".join(str(err).split())
            text = name + text[len(internal) :] if text.startswith(internal) else f"{name}: {text}"
            problems.append((name, text, "invalid_value"))
            continue
        values[internal] = value
    if problems:
        shown = "; ".join(message for _, message, _ in problems[:PROBLEMS_SHOWN])
        more = f" (and {len(problems) - PROBLEMS_SHOWN} more)" if len(problems) > PROBLEMS_SHOWN else ""
        raise ApiError(400, shown + more, param=problems[0][0][:64], code=problems[0][2])
    try:
        return parse_params(**values)
    except ParameterError as err:
        raise ApiError(400, str(err), code="invalid_value") from None


def api_params(params: dict[str, Any]) -> dict[str, Any]:
    """A job's parameters under their SGLang names."""
    return {api: params.get(internal) for api, internal in FIELDS.items()}


def latent_rate(fields: dict[str, str]) -> str:
    """The rate of an uploaded latent (`fps`, taken out of `fields`), refused with its field before the latent is
    read: a missing or bad rate, a scale a latent cannot take, or `fps_mode`, which only a clip has."""
    if "fps_mode" in fields:
        raise ApiError(
            400,
            f"fps_mode is for a clip; a latent is played at its {RATE_FIELD}",
            param="fps_mode",
            code="conflicting_fields",
        )
    raw = fields.pop(RATE_FIELD, None)
    if raw is None:
        raise ApiError(
            400,
            f"{LATENT_FIELD} needs the form field {RATE_FIELD!r}: the latent's frame rate (e.g. 24 or 30000/1001)",
            param=RATE_FIELD,
            code="missing_fps",
        )
    try:
        rate = parse_rate(raw)
    except ParameterError as err:
        raise ApiError(400, str(err), param=RATE_FIELD, code="invalid_value") from None
    return str(rate)
