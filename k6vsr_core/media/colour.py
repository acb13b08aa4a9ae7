"""A source's colour: its tags and HDR metadata as decoded, and the tags its output is written with, or the reason
it is refused.

The model was trained on 8-bit SDR RGB (contract §A.3: pixels / 128 - 1), so the pipeline hands it the source's RGB
code values as they are, decoded with the source's own matrix and range, and writes its output back with the same
matrix and primaries and transfer tags: a BT.601 SD source comes back BT.601. A source of more than 8 bits going to
an output of more than 8 bits passes at 16 bits a sample (`k6vsr_core.model.stages`): its code values are handed to
the model as they are, scaled to the same range, so a PQ or HLG (BT.2020) source comes back PQ or HLG, with its
mastering-display and content-light metadata. What cannot be carried (HDR or BT.2020 through an 8-bit path, an
unknown matrix, primaries or transfer) is refused with the reason, never written under another colour's tags.
"""

from __future__ import annotations

import av

from k6vsr_core.errors import UnsupportedColour
from k6vsr_core.media.checking import MATRICES, PRIMARIES, TRANSFERS, ColourTags
from k6vsr_core.media.hdr import HdrMetadata

HDR_TRANSFERS = {"smpte2084": "HDR10 (PQ, smpte2084)", "arib-std-b67": "HLG (arib-std-b67)"}
# The SDR colours the 8-bit path writes back as they came: their matrix is one swscale converts both ways, and
# their primaries and transfer need nothing but their tags.
_SDR_MATRICES = ("bt709", "smpte170m", "bt470bg")
_SDR_PRIMARIES = ("bt709", "smpte170m", "bt470bg", "bt470m", "unspecified")
_SDR_TRANSFERS = ("bt709", "smpte170m", "gamma22", "gamma28", "iec61966-2-1", "bt2020-10", "bt2020-12", "unspecified")
# The primaries and transfer a matrix's standard implies, for the tags a source leaves unspecified (BT.709; BT.601's
# 525 lines, SMPTE 170M, and 625 lines, BT.470 BG, both with the BT.709 curve under its BT.601 name).
_COMPANIONS = {
    "bt709": ("bt709", "bt709"),
    "smpte170m": ("smpte170m", "smpte170m"),
    "bt470bg": ("bt470bg", "smpte170m"),
    "bt2020nc": ("bt2020", "bt2020-10"),
}

# FFmpeg's codes by name, for writing tags and choosing swscale's matrix.
PRIMARY_CODES = {name: code for code, name in PRIMARIES.items()}
TRANSFER_CODES = {name: code for code, name in TRANSFERS.items()}
MATRIX_CODES = {name: code for code, name in MATRICES.items()}


def frame_colour(frame: av.VideoFrame) -> ColourTags:
    """A decoded frame's colour tags; the decoder sets them from the stream (VUI, colr box) on every frame."""
    return ColourTags.of_codes(frame.color_primaries, frame.color_trc, frame.colorspace, frame.color_range)


def output_colour(
    path: str, source: ColourTags, hdr: HdrMetadata | None = None, eight_bit: str | None = "the path is 8-bit"
) -> ColourTags:
    """The tags the output of a source tagged `source` is written with, or :class:`UnsupportedColour` saying why
    it cannot be carried faithfully. `eight_bit` says why the frames pass through the model at 8 bits (an 8-bit
    source, an 8-bit output asked for), or is None where they pass at 16 (a 10-bit source to a 10-bit output):
    only that path carries PQ, HLG and BT.2020, and HDR metadata.

    Every tag the source gives is kept; one it leaves unspecified is its matrix's standard's, and an untagged (or
    RGB) source is BT.709, as before: an untagged or BT.709 source is written BT.709, a BT.601 one BT.601, a BT.2020
    one BT.2020. The output is always limited range: a full-range source is converted to it, not retagged.
    """
    problem = _refusal(source, hdr, eight_bit)
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


def _refusal(source: ColourTags, hdr: HdrMetadata | None, eight_bit: str | None) -> str | None:
    wide = source.primaries == "bt2020" or source.matrix.startswith("bt2020")
    if eight_bit is not None:
        if source.transfer in HDR_TRANSFERS:
            return (
                f"an {HDR_TRANSFERS[source.transfer]} source goes through the model at 10 bits or not at all, and "
                f"{eight_bit}: its code values and HDR metadata would be lost"
            )
        if hdr is not None:
            return f"the stream carries HDR mastering or content-light metadata, and {eight_bit}"
        if wide:
            return f"a BT.2020 wide-gamut source goes through the model at 10 bits or not at all, and {eight_bit}"
    if source.matrix == "bt2020c":
        return "the BT.2020 constant-luminance matrix (bt2020c) cannot be converted to RGB and back here"
    if source.matrix not in (*_SDR_MATRICES, "bt2020nc", "unspecified", "gbr"):
        return (
            f"matrix {source.matrix} is not one the output can be written with ({', '.join(_SDR_MATRICES)}, bt2020nc)"
        )
    if source.primaries not in (*_SDR_PRIMARIES, "bt2020"):
        return f"primaries {source.primaries} are not supported ({', '.join(_SDR_PRIMARIES[:-1])}, bt2020)"
    if source.transfer not in (*_SDR_TRANSFERS, *HDR_TRANSFERS):
        known = ", ".join((*_SDR_TRANSFERS[:-1], *HDR_TRANSFERS))
        return f"transfer {source.transfer} is not a curve the output can be written with ({known})"
    return None
