"""How the output video is encoded: codec, quality, speed preset, pixel format and the container they go in.

The default is the contract's file (H.264, yuv420p, CRF 18 in MP4), with the same bytes from every encode of the same
frames (see `x264_instructions`).
FFV1 is lossless and goes in Matroska; with its default pixel format (8-bit RGB) decoding it gives back exactly
the RGB frames the blend stage stored.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

Codec = Literal["h264", "hevc", "ffv1"]
PixFmt = Literal["yuv420p", "yuv420p10le", "yuv444p"]

CODECS: tuple[str, ...] = ("h264", "hevc", "ffv1")
PIX_FMTS: tuple[str, ...] = ("yuv420p", "yuv420p10le", "yuv444p")
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
_ENCODERS = {"h264": "libx264", "hevc": "libx265", "ffv1": "ffv1"}
# FFV1 stores 8-bit RGB losslessly as bgr0: the frames come back exactly as stored.
_FFV1_RGB = "bgr0"


class VideoEncoding(BaseModel):
    """A validated encoding (see `UpscaleParams.encoding`)."""

    model_config = ConfigDict(frozen=True)

    codec: Codec = "h264"
    crf: int | None = None  # None: DEFAULT_CRF for h264/hevc; FFV1 has none
    preset: str | None = None  # None: the encoder's own default (x264/x265 "medium")
    pix_fmt: PixFmt | None = None  # None: yuv420p for h264/hevc, RGB (lossless) for ffv1

    @property
    def encoder(self) -> str:
        return _ENCODERS[self.codec]

    @property
    def codec_name(self) -> str:
        """The codec's name as FFmpeg's decoders report it, reading the file back."""
        return self.codec

    @property
    def container(self) -> str:
        """The FFmpeg muxer: Matroska for FFV1 (MP4 cannot hold it), MP4 otherwise."""
        return "matroska" if self.codec == "ffv1" else "mp4"

    @property
    def suffix(self) -> str:
        return ".mkv" if self.codec == "ffv1" else ".mp4"

    @property
    def stream_pix_fmt(self) -> str:
        """The pixel format written into the stream."""
        if self.pix_fmt is not None:
            return self.pix_fmt
        return _FFV1_RGB if self.codec == "ffv1" else "yuv420p"

    @property
    def is_rgb(self) -> bool:
        return self.stream_pix_fmt == _FFV1_RGB

    @property
    def needs_even_size(self) -> bool:
        """Chroma subsampled 2x2: an odd side is padded by one row or column."""
        return self.stream_pix_fmt.startswith("yuv420")

    @property
    def is_default(self) -> bool:
        return self == VideoEncoding()

    def options(self) -> dict[str, str]:
        """The encoder's private options. The contract's file gets {"crf": "18"}, and x264 its instruction sets."""
        if self.codec == "ffv1":
            # Version 3 with slice CRCs: the archival setting; one slice per thread count would vary with the host.
            return {"level": "3", "slicecrc": "1", "slices": "4", "threads": "1"}
        options = {"crf": str(DEFAULT_CRF if self.crf is None else self.crf)}
        if self.preset is not None:
            options["preset"] = self.preset
        if self.codec == "h264" and (instructions := x264_instructions()):
            options["x264-params"] = f"asm={instructions}"
        if self.codec == "hevc":
            options["x265-params"] = "log-level=error:frame-threads=1:pools=none"
        return options

    def describe(self) -> dict[str, object]:
        """What was written, for summaries and manifests."""
        return {
            "codec": self.codec,
            "encoder": self.encoder,
            "crf": None if self.codec == "ffv1" else (DEFAULT_CRF if self.crf is None else self.crf),
            "preset": self.preset,
            "pix_fmt": self.stream_pix_fmt,
            "container": "mkv" if self.codec == "ffv1" else "mp4",
        }


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
    set below AVX-512 gives the same bytes every time (tests/test_encoding_determinism.py). So on a CPU with AVX-512
    x264 is told the CPU's other instruction sets; elsewhere it detects them itself.
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
    if crf is not None:
        if codec == "ffv1":
            problems.append(f"crf={crf} does not apply to codec=ffv1, which is lossless; leave crf unset")
        elif not CRF_RANGE[0] <= crf <= CRF_RANGE[1]:
            problems.append(f"crf={crf} is out of range; allowed: {CRF_RANGE[0]} to {CRF_RANGE[1]}")
    if preset is not None:
        if codec == "ffv1":
            problems.append(f"preset={preset!r} does not apply to codec=ffv1; leave preset unset")
        elif preset not in PRESETS:
            problems.append(f"preset={preset!r} is not known; allowed: {', '.join(PRESETS)}")
    return problems
