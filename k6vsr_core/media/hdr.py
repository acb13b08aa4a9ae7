"""Static HDR metadata: the mastering display (SMPTE ST 2086) and content light level (CTA-861.3) a stream's frames
carry, read from a decoded frame, handed to the encoders that write it, and compared in the health check."""

from __future__ import annotations

import struct
from fractions import Fraction

import av
from av.sidedata.sidedata import SideDataContainer
from av.sidedata.sidedata import Type as SideDataType
from pydantic import BaseModel, ConfigDict

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

    def describe(self) -> str:
        """E.g. `mastering display 0.005-1000 cd/m² (R 0.708,0.292 G 0.17,0.797 B 0.131,0.046 W 0.3127,0.329),
        content light MaxCLL 1000, MaxFALL 400 cd/m²`."""
        parts = []
        if self.mastering is not None:
            shown = self.mastering
            points = " ".join(
                f"{name} {float(x):.4g},{float(y):.4g}"
                for name, (x, y) in (("R", shown.red), ("G", shown.green), ("B", shown.blue), ("W", shown.white))
            )
            low, high = float(shown.min_luminance), float(shown.max_luminance)
            parts.append(f"mastering display {low:g}-{high:g} cd/m² ({points})")
        if self.light is not None:
            parts.append(f"content light MaxCLL {self.light.max_cll}, MaxFALL {self.light.max_fall} cd/m²")
        return ", ".join(parts)


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


def hdr_parameters(codec: str, hdr: HdrMetadata) -> tuple[str, str]:
    """The encoder's option and its value that write `hdr` (the SEI messages or metadata OBUs decoders turn back into
    the side data): x265's `master-display` and `max-cll`, x264's `mastering-display` and `cll` (both in units of
    0.00002 for chromaticities, 0.0001 cd/m² for luminance), SVT-AV1's `mastering-display` and `content-light` (in
    plain numbers)."""
    if codec not in ("hevc", "h264", "av1"):
        raise ValueError(f"HDR metadata is written by x265, x264 and SVT-AV1 only, not by codec={codec}")
    parts = []
    if hdr.mastering is not None:
        shown = hdr.mastering
        if codec == "av1":

            def xy(point: tuple[Fraction, Fraction]) -> str:
                return f"({float(point[0]):.5f},{float(point[1]):.5f})"

            luminance = f"L({float(shown.max_luminance):.4f},{float(shown.min_luminance):.4f})"
        else:

            def xy(point: tuple[Fraction, Fraction]) -> str:
                return f"({round(point[0] * 50000)},{round(point[1] * 50000)})"

            luminance = f"L({round(shown.max_luminance * 10000)},{round(shown.min_luminance * 10000)})"
        name = "master-display" if codec == "hevc" else "mastering-display"
        parts.append(f"{name}=G{xy(shown.green)}B{xy(shown.blue)}R{xy(shown.red)}WP{xy(shown.white)}{luminance}")
    if hdr.light is not None:
        name = {"hevc": "max-cll", "h264": "cll", "av1": "content-light"}[codec]
        parts.append(f"{name}={hdr.light.max_cll},{hdr.light.max_fall}")
    option = {"hevc": "x265-params", "h264": "x264-params", "av1": "svtav1-params"}[codec]
    return option, ":".join(parts)


def hdr_differences(seen: HdrMetadata | None, planned: HdrMetadata | None) -> list[str]:
    """How the HDR metadata a file's first frame carries differs from the planned one; empty when it matches, within
    the precision each codec stores it in (AV1 keeps chromaticities in 1/65536, x264 and x265 in 1/50000)."""
    if _matches(seen, planned):
        return []
    shown = [value.describe() if value is not None else "none" for value in (seen, planned)]
    return [f"HDR metadata {shown[0]}, {shown[1]} planned"]


def _matches(seen: HdrMetadata | None, planned: HdrMetadata | None) -> bool:
    if seen is None or planned is None:
        return seen is planned
    if seen.light != planned.light or (seen.mastering is None) != (planned.mastering is None):
        return False
    if seen.mastering is None or planned.mastering is None:
        return True
    ours, theirs = seen.mastering, planned.mastering
    points = [
        (a, b)
        for name in ("red", "green", "blue", "white")
        for a, b in zip(getattr(ours, name), getattr(theirs, name), strict=True)
    ]
    luminances = [(ours.max_luminance, theirs.max_luminance), (ours.min_luminance, theirs.min_luminance)]
    return all(abs(a - b) <= Fraction(1, 50000) for a, b in points) and all(
        abs(a - b) <= max(Fraction(1, 10000), b / 10000) for a, b in luminances
    )
