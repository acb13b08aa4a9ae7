"""How the output video is encoded: codec, quality, speed preset, pixel format and the container they go in.

The default is the contract's file (H.264, yuv420p, CRF 18 in MP4), with the same bytes from every encode of the same
frames (see `x264_instructions`).
FFV1 is lossless and goes in Matroska; with its default pixel format (8-bit RGB) decoding it gives back exactly
the RGB frames the blend stage stored. The mezzanine codecs go in QuickTime (MOV), as post-production expects them:
ProRes (prores_ks) is 422 HQ in yuv422p10le (its default) and 4444 in yuv444p10le or yuva444p10le (alpha opaque),
DNxHR is HQX (yuv422p10le only); AV1 (SVT-AV1) is delivered 10-bit 4:2:0 in MP4.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

Codec = Literal["h264", "hevc", "ffv1", "prores", "dnxhr", "av1"]
PixFmt = Literal["yuv420p", "yuv420p10le", "yuv444p", "yuv444p10le", "yuv422p10le", "yuva444p10le", "gbrp10le"]

CODECS: tuple[str, ...] = ("h264", "hevc", "ffv1", "prores", "dnxhr", "av1")
# The pixel formats each codec is written in; the first is its default (FFV1's default is lossless RGB instead).
_CODEC_PIX_FMTS: dict[str, tuple[str, ...]] = {
    "h264": ("yuv420p", "yuv420p10le", "yuv444p", "yuv444p10le"),
    "hevc": ("yuv420p", "yuv420p10le", "yuv444p", "yuv444p10le"),
    "ffv1": ("yuv420p", "yuv420p10le", "yuv444p", "yuv444p10le", "gbrp10le"),
    "prores": ("yuv422p10le", "yuv444p10le", "yuva444p10le"),
    "dnxhr": ("yuv422p10le",),
    "av1": ("yuv420p10le",),
}
PIX_FMTS: tuple[str, ...] = tuple(dict.fromkeys(f for fmts in _CODEC_PIX_FMTS.values() for f in fmts))
# x264 and x265 share these names.
PRESETS: tuple[str, ...] = (
    "ultrafast",
    "superfast",
    "veryfast",
    "faster",
    "fast",
    "medium",
    "slow",
    "slower",
    "veryslow",
    "placebo",
)
# Both encoders' CRF scale is 0..51 for 8-bit; 10-bit x264 goes lower, which nobody needs for delivery.
CRF_RANGE = (0, 51)
DEFAULT_CRF = 18
# SVT-AV1's CRF scale; 30 is a delivery quality a step above its own default (35).
AV1_CRF_RANGE = (0, 63)
DEFAULT_AV1_CRF = 30
# SVT-AV1's presets: 0 (slowest) to 13 (fastest).
AV1_PRESETS: tuple[str, ...] = tuple(str(n) for n in range(14))
_ENCODERS = {
    "h264": "libx264",
    "hevc": "libx265",
    "ffv1": "ffv1",
    "prores": "prores_ks",
    "dnxhr": "dnxhd",
    "av1": "libsvtav1",
}
# FFmpeg's codec names, as a file read back reports them (DNxHR is a profile of FFmpeg's DNxHD codec).
_CODEC_NAMES = {"dnxhr": "dnxhd"}
_CONTAINERS = {"ffv1": ("matroska", ".mkv"), "prores": ("mov", ".mov"), "dnxhr": ("mov", ".mov")}
SUFFIXES: tuple[str, ...] = (".mp4", ".mkv", ".mov")
_MEDIA_TYPES = {".mp4": "video/mp4", ".mkv": "video/x-matroska", ".mov": "video/quicktime"}
# The smallest frame (H, W) each encoder takes: x265 (see media.writing) and FFmpeg's DNxHR encoder.
MIN_SIZES: dict[str, tuple[int, int]] = {"hevc": (128, 128), "dnxhr": (120, 256)}
# The codecs whose quality is a CRF and whose speed is a preset; the intra mezzanine codecs have a fixed profile.
_CRF_CODECS = ("h264", "hevc", "av1")
# FFV1 stores 8-bit RGB losslessly as bgr0: the frames come back exactly as stored; 10-bit RGB as gbrp10le.
_FFV1_RGB = "bgr0"
_RGB = (_FFV1_RGB, "gbrp10le")
# Pixel formats of more than 8 bits: what a 10-bit source is written in unless an 8-bit one is asked for. FFV1's
# default then is 4:4:4 YUV, not RGB: its RGB streams carry no colour tags, and an HDR source needs them.
DEEP_PIX_FMTS: tuple[str, ...] = ("yuv420p10le", "yuv422p10le", "yuv444p10le", "yuva444p10le", "gbrp10le")
_DEEP_DEFAULTS = {"h264": "yuv420p10le", "hevc": "yuv420p10le", "ffv1": "yuv444p10le"}
# The encoders that write static HDR metadata (mastering display, content light) from their own parameters; PyAV
# cannot hand the others' muxers the stream side data they would take it from.
HDR_METADATA_CODECS: tuple[str, ...] = ("h264", "hevc", "av1")


class VideoEncoding(BaseModel):
    """A validated encoding (see `UpscaleParams.encoding`)."""

    model_config = ConfigDict(frozen=True)

    codec: Codec = "h264"
    crf: int | None = None  # None: DEFAULT_CRF for h264/hevc, DEFAULT_AV1_CRF for av1; the others have none
    preset: str | None = None  # None: the encoder's own default (x264/x265 "medium", SVT-AV1's)
    pix_fmt: PixFmt | None = None  # None: the codec's first in _CODEC_PIX_FMTS, RGB (lossless) for ffv1

    @property
    def encoder(self) -> str:
        return _ENCODERS[self.codec]

    @property
    def codec_name(self) -> str:
        """The codec's name as FFmpeg reports it, reading the file back."""
        return _CODEC_NAMES.get(self.codec, self.codec)

    @property
    def container(self) -> str:
        """The FFmpeg muxer: Matroska for FFV1 (MP4 cannot hold it), MOV for ProRes and DNxHR, MP4 otherwise."""
        return _CONTAINERS.get(self.codec, ("mp4", ".mp4"))[0]

    @property
    def suffix(self) -> str:
        return _CONTAINERS.get(self.codec, ("mp4", ".mp4"))[1]

    @property
    def media_type(self) -> str:
        return _MEDIA_TYPES[self.suffix]

    @property
    def stream_pix_fmt(self) -> str:
        """The pixel format written into the stream."""
        if self.pix_fmt is not None:
            return self.pix_fmt
        return _FFV1_RGB if self.codec == "ffv1" else _CODEC_PIX_FMTS[self.codec][0]

    @property
    def profile(self) -> str | None:
        """The encoder's profile, for the codecs that have a fixed one: ProRes 422 HQ or 4444, DNxHR HQX."""
        if self.codec == "prores":
            return "4444" if "444" in self.stream_pix_fmt else "hq"
        return "dnxhr_hqx" if self.codec == "dnxhr" else None

    @property
    def tags_frames(self) -> bool:
        """Whether the encoder takes colour tags from each frame rather than from the stream."""
        return self.codec == "prores"

    @property
    def is_rgb(self) -> bool:
        return self.stream_pix_fmt in _RGB

    @property
    def is_deep(self) -> bool:
        """Whether the stream holds more than 8 bits a sample."""
        return self.stream_pix_fmt in DEEP_PIX_FMTS

    def for_deep_source(self) -> VideoEncoding:
        """This encoding for a source of more than 8 bits: a pixel format left to the default becomes the codec's
        10-bit one, so that nothing between the source and the file is 8-bit; one asked for is kept."""
        if self.pix_fmt is not None or self.is_deep:
            return self
        return self.model_copy(update={"pix_fmt": _DEEP_DEFAULTS[self.codec]})

    @property
    def even_sides(self) -> tuple[bool, bool]:
        """Whether the height and the width must be even (chroma subsampled 2x2 or 2x1): an odd side is padded by
        one row or column."""
        fmt = self.stream_pix_fmt
        return fmt.startswith("yuv420"), fmt.startswith(("yuv420", "yuv422"))

    def stored_size(self, height: int, width: int) -> tuple[int, int]:
        """The (H, W) written for frames of (height, width), after padding to even sides where needed."""
        even_h, even_w = self.even_sides
        return height + (height % 2 if even_h else 0), width + (width % 2 if even_w else 0)

    def size_problem(self, height: int, width: int, what: str = "frames") -> str | None:
        """Why this encoder cannot take `what` (frames, an output) of (height, width), or None."""
        least = MIN_SIZES.get(self.codec)
        if least is None or (height >= least[0] and width >= least[1]):
            return None
        return f"codec={self.codec} needs {what} of at least {least[1]}x{least[0]} pixels, got {width}x{height}"

    @property
    def is_default(self) -> bool:
        return self == VideoEncoding()

    def options(self) -> dict[str, str]:
        """The encoder's private options. The contract's file gets {"crf": "18"}, and x264 its instruction sets."""
        if self.codec == "ffv1":
            # Version 3 with slice CRCs: the archival setting; one slice per thread count would vary with the host.
            return {"level": "3", "slicecrc": "1", "slices": "4", "threads": "1"}
        if self.profile is not None:
            return {"profile": self.profile}
        options = {"crf": str(self.effective_crf)}
        if self.preset is not None:
            options["preset"] = self.preset
        if self.codec == "h264" and (instructions := x264_instructions()):
            options["x264-params"] = f"asm={instructions}"
        if self.codec == "hevc":
            options["x265-params"] = "log-level=error:frame-threads=1:pools=none"
        return options

    @property
    def effective_crf(self) -> int | None:
        if self.codec not in _CRF_CODECS:
            return None
        if self.crf is not None:
            return self.crf
        return DEFAULT_AV1_CRF if self.codec == "av1" else DEFAULT_CRF

    def describe(self) -> dict[str, object]:
        """What was written, for summaries and manifests (the profile only for the codecs that have one)."""
        described: dict[str, object] = {
            "codec": self.codec,
            "encoder": self.encoder,
            "crf": self.effective_crf,
            "preset": self.preset,
            "pix_fmt": self.stream_pix_fmt,
            "container": self.suffix[1:],
        }
        if self.profile is not None:
            described["profile"] = self.profile
        return described


# x264's names for the instruction sets it uses, by the flag Linux lists in /proc/cpuinfo for each.
_X264_INSTRUCTIONS = {
    "sse": "SSE",
    "sse2": "SSE2",
    "pni": "SSE3",
    "ssse3": "SSSE3",
    "sse4_1": "SSE4.1",
    "sse4_2": "SSE4.2",
    "avx": "AVX",
    "fma": "FMA3",
    "avx2": "AVX2",
    "bmi1": "BMI1",
    "bmi2": "BMI2",
    "abm": "LZCNT",
}


@functools.cache
def x264_instructions(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The instruction sets x264 may use here, without AVX-512; None where x264 should pick for itself.

    With its AVX-512 code, x264 (as built into PyAV's wheels) reads memory it never wrote: the same frames then give
    different bytes from one encode to the next, depending on what the process allocated before. Every instruction
    set below AVX-512 gives the same bytes every time (tests/contract/test_encoding_determinism.py). So on a CPU
    with AVX-512 x264 is told the CPU's other instruction sets; elsewhere it detects them itself.
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    if not any(flag.startswith("avx512") for flag in flags):
        return None
    names = [name for flag, name in _X264_INSTRUCTIONS.items() if flag in flags]
    return ",".join(["MMX2", *names]) if names else None


def check_encoding(codec: str, crf: int | None, preset: str | None, pix_fmt: str | None) -> list[str]:
    """One message per invalid choice or combination, each naming its flag; empty when all is well."""
    problems = []
    if codec not in CODECS:
        return [f"codec={codec!r} is not supported; allowed: {', '.join(CODECS)}"]
    if pix_fmt is not None and pix_fmt not in PIX_FMTS:
        problems.append(f"pix_fmt={pix_fmt!r} is not supported; allowed: {', '.join(PIX_FMTS)}")
    elif pix_fmt is not None and pix_fmt not in _CODEC_PIX_FMTS[codec]:
        problems.append(
            f"pix_fmt={pix_fmt!r} does not apply to codec={codec}; allowed: {', '.join(_CODEC_PIX_FMTS[codec])}"
        )
    lossless = ", which is lossless" if codec == "ffv1" else ""
    crf_range = AV1_CRF_RANGE if codec == "av1" else CRF_RANGE
    presets = AV1_PRESETS if codec == "av1" else PRESETS
    if crf is not None:
        if codec not in _CRF_CODECS:
            problems.append(f"crf={crf} does not apply to codec={codec}{lossless}; leave crf unset")
        elif not crf_range[0] <= crf <= crf_range[1]:
            problems.append(f"crf={crf} is out of range for codec={codec}; allowed: {crf_range[0]} to {crf_range[1]}")
    if preset is not None:
        if codec not in _CRF_CODECS:
            problems.append(f"preset={preset!r} does not apply to codec={codec}; leave preset unset")
        elif preset not in presets:
            problems.append(f"preset={preset!r} is not known to codec={codec}; allowed: {', '.join(presets)}")
    return problems
