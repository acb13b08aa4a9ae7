"""A source clip before any model work: probed, scanned for its decodable frames, planned, its audio chosen.

No torch here: ingest reads the source in processes that never compute a tensor.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
from pydantic import BaseModel

from k6vsr_core import media
from k6vsr_core.contract.params import UpscaleParams
from k6vsr_core.contract.plan import ClipPlan, ModelTraits, make_plan, scene_cuts
from k6vsr_core.contract.windows import Window
from k6vsr_core.errors import MediaError, UnsupportedColour
from k6vsr_core.media.colour import HDR_TRANSFERS
from k6vsr_core.media.encoding import HDR_METADATA_CODECS
from k6vsr_core.media.reading import Depth


class SourceClip(BaseModel):
    """A source probed, scanned and planned: what the first stage hands on (no frames: windows read their own)."""

    model_config = {"arbitrary_types_allowed": True}

    path: str
    frame_pts: np.ndarray | None  # timestamps of every frame, to seek to a window (media.scan_frames)
    rotation: int  # display rotation of the source, carried to the output
    plan: ClipPlan


def read_source(
    path: str | Path, params: UpscaleParams, traits: ModelTraits, planned: ClipPlan | None = None
) -> SourceClip:
    """Probe and scan a source, and plan it on the frames that can actually be decoded.

    `planned`, the plan made from the probe's frame count, is kept when every frame it counted decodes (the scan is
    the only input of the plan that the probe may have got wrong) and its scene cuts are not still to be found.
    """
    probe = media.probe(path)
    count, frame_pts = media.scan_frames(path)
    if count < probe.num_frames:
        warnings.warn(
            f"{path}: only {count} of {probe.num_frames} frame(s) could be decoded (truncated or damaged file?)",
            stacklevel=2,
        )
    if planned is not None and planned.source_frames == count and not planned.cuts_pending:
        return SourceClip(path=str(path), frame_pts=frame_pts, rotation=probe.rotation, plan=planned)
    fields = planned.fields if planned is not None else media.probe_fields(path)
    pixels = pixel_path(str(path), probe, params)
    try:
        plan = plan_probed(str(path), probe, count, params, traits, pixels, fields)
    except ValueError as err:
        raise MediaError(str(path), str(err)) from None
    return SourceClip(path=str(path), frame_pts=frame_pts, rotation=probe.rotation, plan=plan)


class PixelPath(NamedTuple):
    """How a source's pixels pass through the model: the output's colour tags, the depth of every stage's frames
    (8: uint8; 16: uint16, for a source of more than 8 bits to an output of more than 8) and the HDR metadata
    written."""

    colour: media.ColourTags
    depth: Depth
    hdr: media.HdrMetadata | None


def pixel_path(path: str, probe: media.VideoProbe, params: UpscaleParams) -> PixelPath:
    """The pixel path of `probe`'s source under `params`, or :class:`UnsupportedColour` saying why it cannot carry
    the source faithfully. A 10-bit source goes to a 10-bit output unless an 8-bit pixel format is asked for; only
    then, and from an 8-bit source, are its frames 8-bit."""
    deep = params.encoding.for_deep_source()
    eight_bit = None
    if probe.bit_depth <= 8:
        eight_bit = f"the source is {probe.bit_depth}-bit"
    elif not deep.is_deep:
        eight_bit = f"pix_fmt={deep.stream_pix_fmt} is 8-bit (leave --pix-fmt unset, or ask for a 10-bit one)"
    colour = media.output_colour(path, probe.colour, probe.hdr, eight_bit)
    if deep.is_rgb and (colour.primaries == "bt2020" or colour.transfer in HDR_TRANSFERS):
        raise UnsupportedColour(
            path,
            f"colour {probe.colour.describe()}: pix_fmt={deep.stream_pix_fmt} writes RGB without colour tags, which "
            "would play as BT.709; leave --pix-fmt unset or ask for a YUV one; nothing was written",
        )
    if probe.hdr is not None and deep.codec not in HDR_METADATA_CODECS:
        raise UnsupportedColour(
            path,
            f"colour {probe.colour.describe()}: its mastering-display and content-light metadata cannot be written "
            f"with codec={deep.codec}; use {', '.join(HDR_METADATA_CODECS)}; nothing was written",
        )
    return PixelPath(colour=colour, depth=8 if eight_bit is not None else 16, hdr=probe.hdr)


def plan_probed(
    path: str,
    probe: media.VideoProbe,
    frames: int,
    params: UpscaleParams,
    traits: ModelTraits,
    pixels: PixelPath,
    fields: media.FieldInfo | None,
    find_cuts: bool = True,
) -> ClipPlan:
    """The plan of a probed source of `frames` frames: its frame times read, its scene cuts looked for (unless not
    `find_cuts`: the plan is then `cuts_pending`), its pixel shape, colour, depth and fields as found."""
    times = media.frame_times(path)
    cuts = scene_cuts(path, frames, probe.fps, params, times) if find_cuts else None
    return make_plan(
        (probe.height, probe.width),
        frames,
        probe.fps,
        params,
        traits,
        probe.rate,
        cuts,
        colour=pixels.colour,
        depth=pixels.depth,
        hdr=pixels.hdr,
        source_aspect=probe.sample_aspect,
        fields=fields,
        frame_times=times,
    )


def audio_input(source: str | Path, params: UpscaleParams) -> str | None:
    """The file whose audio is mixed to the contract's format: the source, a separate file, or none."""
    if params.audio in ("none", "original"):
        return None  # `original` carries the source's streams as they are, at the join
    return params.audio_file or str(source)


def source_audio(source: str | Path, params: UpscaleParams) -> np.ndarray | None:
    """The mono 44.1 kHz track the request writes, if any."""
    path = audio_input(source, params)
    return None if path is None else media.decode_audio(path)


def read_window(source: SourceClip, window: Window) -> np.ndarray:
    """The source frames of one window, decoded from the file."""
    plan = source.plan
    return media.read_frames(source.path, plan.source_indices(window), source.frame_pts, plan.deinterlace, plan.depth)
