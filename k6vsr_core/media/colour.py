"""A source's colour: its tags and HDR metadata as decoded, and the tags its output is written with, or the reason
it is refused.

The model was trained on 8-bit SDR RGB (contract §A.3: pixels / 128 - 1), so the pipeline hands it the source's RGB
code values as they are, decoded with the source's own matrix and range, and writes its output back with the same
matrix and primaries and transfer tags: a BT.601 SD source comes back BT.601. What an 8-bit SDR path cannot carry
(PQ or HLG HDR, BT.2020 wide gamut, an unknown matrix, primaries or transfer) is refused with the reason, never
written under another colour's tags.
"""

from __future__ import annotations

import struct
from fractions import Fraction

import av
from av.sidedata.sidedata import SideDataContainer
from av.sidedata.sidedata import Type as SideDataType
from pydantic import BaseModel, ConfigDict

from k6vsr_core.errors import UnsupportedColour
from k6vsr_core.media.checking import MATRICES, PRIMARIES, TRANSFERS, ColourTags

HDR_TRANSFERS = {"smpte2084": "HDR10 (PQ, smpte2084)", "arib-std-b67": "HLG (arib-std-b67)"}
# The SDR colours the 8-bit path writes back as they came: their matrix is one swscale converts both ways, and
# their primaries and transfer need nothing but their tags.
_SDR_MATRICES = ("bt709", "smpte170m", "bt470bg")
_SDR_PRIMARIES = ("bt709", "smpte170m", "bt470bg", "bt470m", "unspecified")
_SDR_TRANSFERS = ("bt709", "smpte170m", "gamma22", "gamma28", "iec61966-2-1", "unspecified")
# The primaries and transfer a matrix's standard implies, for the tags a source leaves unspecified (BT.709; BT.601's
# 525 lines, SMPTE 170M, and 625 lines, BT.470 BG, both with the BT.709 curve under its BT.601 name).
_COMPANIONS = {
    "bt709": ("bt709", "bt709"),
    "smpte170m": ("smpte170m", "smpte170m"),
    "bt470bg": ("bt470bg", "smpte170m"),
}

# FFmpeg's codes by name, for writing tags and choosing swscale's matrix.
PRIMARY_CODES = {name: code for code, name in PRIMARIES.items()}
TRANSFER_CODES = {name: code for code, name in TRANSFERS.items()}
MATRIX_CODES = {name: code for code, name in MATRICES.items()}

_MASTERING = SideDataType.MASTERING_DISPLAY_METADATA
_LIGHT_LEVEL = SideDataType.CONTENT_LIGHT_LEVEL


class MasteringDisplay(BaseModel):
    """SMPTE ST 2086 mastering display: CIE 1931 xy of the red, green and blue primaries and the white point, and
    the luminance range in cd/m²."""

    model_config = ConfigDict(frozen=True)

    red: tuple[Fraction, Fraction]
    green: tuple[Fraction, Fraction]
    blue: tuple[Fraction, Fraction]
    white: tuple[Fraction, Fraction]
    min_luminance: Fraction
    max_luminance: Fraction


class ContentLight(BaseModel):
    """CTA-861.3 content light level: the brightest pixel and the brightest frame average, in cd/m²."""

    model_config = ConfigDict(frozen=True)

    max_cll: int
    max_fall: int


class HdrMetadata(BaseModel):
    """The static HDR metadata a stream's first frame carries (either part may be missing)."""

    model_config = ConfigDict(frozen=True)

    mastering: MasteringDisplay | None = None
    light: ContentLight | None = None


def frame_colour(frame: av.VideoFrame) -> ColourTags:
    """A decoded frame's colour tags; the decoder sets them from the stream (VUI, colr box) on every frame."""
    return ColourTags.of_codes(frame.color_primaries, frame.color_trc, frame.colorspace, frame.color_range)


def frame_hdr(frame: av.VideoFrame) -> HdrMetadata | None:
    """The frame's mastering-display and content-light side data, parsed; None when it carries neither.

    PyAV hands side data over as raw bytes: the layouts are libavutil's `AVMasteringDisplayMetadata` (ten
    `AVRational`s, then two `int` flags) and `AVContentLightMetadata` (two `unsigned`).
    """
    mastering = light = None
    # PyAV's stub types `side_data` as a dict of motion vectors; it is a container of `SideData`.
    side_data: SideDataContainer = frame.side_data  # type: ignore[assignment]
    for data in side_data:
        raw = bytes(data)
        if data.type == _MASTERING and len(raw) >= 88:
            values = struct.unpack_from("<20i2i", raw)
            rationals = [Fraction(values[i], values[i + 1]) if values[i + 1] else Fraction(0) for i in range(0, 20, 2)]
            has_primaries, has_luminance = values[20], values[21]
            if has_primaries and has_luminance:
                red, green, blue, white = (tuple(rationals[i : i + 2]) for i in range(0, 8, 2))
                mastering = MasteringDisplay(
                    red=red, green=green, blue=blue, white=white, min_luminance=rationals[8], max_luminance=rationals[9]
                )
        elif data.type == _LIGHT_LEVEL and len(raw) >= 8:
            max_cll, max_fall = struct.unpack_from("<2I", raw)
            light = ContentLight(max_cll=max_cll, max_fall=max_fall)
    return None if mastering is None and light is None else HdrMetadata(mastering=mastering, light=light)


def output_colour(path: str, source: ColourTags, hdr: HdrMetadata | None = None) -> ColourTags:
    """The tags the output of a source tagged `source` is written with, or :class:`UnsupportedColour` saying why
    the 8-bit SDR path cannot carry it.

    Every tag the source gives is kept; one it leaves unspecified is its matrix's standard's, and an untagged (or
    RGB) source is BT.709, as before: an untagged or BT.709 source is written BT.709, a BT.601 one BT.601. The
    output is always limited range: a full-range source is converted to it, not retagged.
    """
    problem = _refusal(source, hdr)
    if problem is not None:
        raise UnsupportedColour(path, f"colour {source.describe()}: {problem}; nothing was written")
    matrix = source.matrix if source.matrix in _COMPANIONS else "bt709"
    primaries, transfer = _COMPANIONS[matrix]
    return ColourTags(
        primaries=primaries if source.primaries == "unspecified" else source.primaries,
        transfer=transfer if source.transfer == "unspecified" else source.transfer,
        matrix=matrix,
        range="tv",
    )


def _refusal(source: ColourTags, hdr: HdrMetadata | None) -> str | None:
    if source.transfer in HDR_TRANSFERS:
        return (
            f"an {HDR_TRANSFERS[source.transfer]} source cannot be upscaled faithfully: the model path is 8-bit SDR "
            "RGB, so its 10-bit code values and HDR metadata would be lost; HDR sources are not supported yet"
        )
    if hdr is not None:
        return "the stream carries HDR mastering or content-light metadata that the 8-bit SDR path would drop"
    if source.primaries == "bt2020" or source.matrix.startswith("bt2020"):
        return "BT.2020 wide-gamut sources (10-bit by definition) are not supported yet: the model path is 8-bit"
    if source.matrix not in (*_SDR_MATRICES, "unspecified", "gbr"):
        return f"matrix {source.matrix} is not one the output can be written with ({', '.join(_SDR_MATRICES)})"
    if source.primaries not in _SDR_PRIMARIES:
        return f"primaries {source.primaries} are not supported ({', '.join(_SDR_PRIMARIES[:-1])})"
    if source.transfer not in _SDR_TRANSFERS:
        known = ", ".join(_SDR_TRANSFERS[:-1])
        return f"transfer {source.transfer} is not an SDR curve the model was trained on ({known})"
    return None


def x265_hdr_params(hdr: HdrMetadata) -> str:
    """x265's `master-display` and `max-cll` parameters for `hdr` (its units: 0.00002 for chromaticities, 0.0001
    cd/m² for luminance), from which it writes the SEI messages that decoders turn back into the side data."""
    parts = []
    if hdr.mastering is not None:
        shown = hdr.mastering

        def xy(point: tuple[Fraction, Fraction]) -> str:
            return f"({round(point[0] * 50000)},{round(point[1] * 50000)})"

        luminance = f"L({round(shown.max_luminance * 10000)},{round(shown.min_luminance * 10000)})"
        parts.append(
            f"master-display=G{xy(shown.green)}B{xy(shown.blue)}R{xy(shown.red)}WP{xy(shown.white)}{luminance}"
        )
    if hdr.light is not None:
        parts.append(f"max-cll={hdr.light.max_cll},{hdr.light.max_fall}")
    return ":".join(parts)
