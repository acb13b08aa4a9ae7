"""A command's request and input flags, checked as the run checks them: a refused value answers at once, before
the store's, the media's or the model's code is imported (tests/command/test_command_start.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from k6vsr_core.contract.params import FPS_MODES, UpscaleParams, parse_params
from k6vsr_core.errors import ParameterError


def params_from(args: argparse.Namespace) -> UpscaleParams:
    given = {name: getattr(args, name) for name in UpscaleParams.model_fields if hasattr(args, name)}
    if getattr(args, "latent", None) is not None:
        given.pop("fps_mode", None)  # --fps is the latent's rate (`input_from`), not a request field
    try:
        return parse_params(**given)
    except ParameterError as err:
        raise ParameterError(f"invalid request: {err}") from None


def input_from(args: argparse.Namespace) -> tuple[Path, str | None]:
    """The run's input and, for a latent, its frame rate: the video, or `--latent FILE` with `--fps RATE`. `--fps`
    keeps its words for a video and takes a rate with `--latent`; anything else is refused here, before any work."""
    video, latent = args.input, getattr(args, "latent", None)
    fps = getattr(args, "fps_mode", None)
    if video is not None and latent is not None:
        raise ParameterError("give a video or --latent FILE.safetensors, not both")
    if latent is None:
        if video is None:
            raise ParameterError("give a video to upscale, or --latent FILE.safetensors with --fps RATE")
        if fps is not None and fps not in FPS_MODES:
            raise ParameterError(
                f"--fps {fps}: a video's --fps is contract or source; a frame rate is given only with --latent"
            )
        return Path(video).expanduser().absolute(), None  # not resolved: a link's name names the output
    if fps is None:
        raise ParameterError("--latent needs --fps RATE, the latent's frame rate (e.g. 24 or 30000/1001)")
    if fps in FPS_MODES:
        raise ParameterError(f"--fps {fps}: with --latent, --fps is the latent's frame rate (e.g. 24 or 30000/1001)")
    return Path(latent).expanduser().absolute(), fps


def check_request(args: argparse.Namespace) -> None:
    """The input and request flags, checked as the run checks them (in that order) but before a source URL is
    fetched or the store's code imported: a refused flag answers at once."""
    input_from(args)
    params_from(args)
