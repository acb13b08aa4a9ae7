"""The archive matrix (issue 46): one table of synthetic sources, each through `k6vsr upscale` on the tiny model
(on the CPU, at a few frames of a few dozen pixels), each output read back as ffprobe would (container, streams,
tags, geometry, frame times) and, where the colour path matters, by its decoded pixels; a source refused on purpose
is shown refused with its reason, nothing written. The sources come from `media_kit`, shared with the tests of each
feature."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from media_kit import (
    anamorphic_source,
    broadcast_source_file,
    colour_source,
    hdr_source,
    interlaced_frames,
    phone_times_ms,
    prores_master,
    write_interlaced,
    write_vfr,
)

from entrypoints.cli import main
from k6vsr_core import UpscaleParams, media, upscale
from k6vsr_core.media.checking import ColourTags
from k6vsr_core.media.sample import make_sample_clip

PHONE_FRAMES = 8


def _tags(primaries: str, transfer: str, matrix: str, range_: str = "tv") -> ColourTags:
    return ColourTags(primaries=primaries, transfer=transfer, matrix=matrix, range=range_)


def _phone(path: Path) -> Path:
    """A phone clip: 32x32 frames 25 to 50 ms apart, shot upright (rotation 90), with half a second of tone."""
    frames = np.stack([np.full((32, 32, 3), 30 + 20 * i, np.uint8) for i in range(PHONE_FRAMES)])
    return write_vfr(path, frames, phone_times_ms(PHONE_FRAMES), audio_s=0.5, rotation=90, tone_hz=440)


def _phone_ms() -> list[Fraction]:
    return [Fraction(t, 1000) for t in phone_times_ms(PHONE_FRAMES)]


@dataclass(frozen=True)
class Case:
    make: Callable[[Path], Path]  # writes the source at the path it is given (its suffix is the case's `suffix`)
    flags: tuple[str, ...] = ()
    expect: dict[str, object] = field(default_factory=dict)  # facts of the output, as `_probe` reads them
    plan: dict[str, object] = field(default_factory=dict)  # `k6vsr plan --json` facts, "section.key": value
    refused: str | None = None  # the reason a source refused on purpose is refused with
    pixels: bool = False  # the output's pixels, decoded as its tags say, are the frames handed to the encoder
    suffix: str = ".mp4"


CASES: dict[str, Case] = {
    "bt709-contract": Case(
        lambda p: make_sample_clip(p, width=32, height=32, num_frames=2),
        expect={
            "format": "mov",
            "codec": "h264",
            "pix_fmt": "yuv420p",
            "size": (64, 64),
            "colour": "bt709/bt709/bt709/tv",
            "frames": 2,
            "rate": "24",
            "streams": [("audio", "aac", "und")],
        },
    ),
    "hdr10-pq": Case(
        lambda p: hdr_source(p, "smpte2084", frames=2),
        expect={
            "codec": "h264",
            "pix_fmt": "yuv420p10le",
            "colour": "bt2020/smpte2084/bt2020nc/tv",
            "hdr": "mastering display 0.005-1000 cd/m² (R 0.708,0.292 G 0.17,0.797 B 0.131,0.046 W 0.3127,0.329), "
            "content light MaxCLL 1000, MaxFALL 400 cd/m²",
            "frames": 2,
        },
        plan={"output_format.pixel_depth": 16},
    ),
    "hlg-hevc": Case(
        lambda p: hdr_source(p, "arib-std-b67", frames=3),
        flags=("--codec", "hevc"),
        expect={"codec": "hevc", "pix_fmt": "yuv420p10le", "colour": "bt2020/arib-std-b67/bt2020nc/tv"},
    ),
    "hdr10-to-8-bit": Case(lambda p: hdr_source(p, "smpte2084"), flags=("--pix-fmt", "yuv420p"), refused="8-bit"),
    "bt2020-8-bit": Case(lambda p: colour_source(p, _tags("bt2020", "bt709", "bt2020nc")), refused="BT.2020"),
    "bt601-ntsc": Case(
        lambda p: colour_source(p, _tags("smpte170m", "smpte170m", "smpte170m"), size=32),
        flags=("--crf", "0", "--pix-fmt", "yuv444p"),
        expect={"pix_fmt": "yuv444p", "colour": "smpte170m/smpte170m/smpte170m/tv", "size": (64, 64)},
        pixels=True,
    ),
    "bt601-pal-full-range": Case(
        lambda p: colour_source(p, _tags("bt470bg", "gamma28", "bt470bg", "pc"), size=32),
        flags=("--crf", "0", "--pix-fmt", "yuv444p"),
        expect={"colour": "bt470bg/gamma28/bt470bg/tv"},
        plan={"source_colour": "bt470bg/gamma28/bt470bg/pc, 8-bit"},
        pixels=True,
    ),
    "untagged": Case(
        lambda p: colour_source(p, _tags("unspecified", "unspecified", "unspecified"), size=32),
        expect={"colour": "bt709/bt709/bt709/tv"},
    ),
    "sd-interlaced-tff": Case(
        lambda p: write_interlaced(p, interlaced_frames(5, top_first=True, size=32), "tff"),
        expect={"frames": 5, "rate": "25", "interlaced": False, "size": (64, 64)},
        plan={"interlacing.field_order": "tff", "interlacing.filter": "bwdif=mode=send_frame:parity=tff:deint=all"},
    ),
    "sd-interlaced-bff": Case(
        lambda p: write_interlaced(p, interlaced_frames(5, top_first=False, size=32), "bff"),
        expect={"frames": 5, "interlaced": False},
        plan={"interlacing.field_order": "bff", "interlacing.filter": "bwdif=mode=send_frame:parity=bff:deint=all"},
    ),
    "pal-4:3-anamorphic": Case(
        lambda p: anamorphic_source(p, 90, 72, Fraction(16, 15)),
        expect={"size": (180, 144), "sar": "16/15", "dar": "4/3"},
        plan={"aspect.display_aspect": "4/3"},
    ),
    "phone-vfr-rotated-source-timing": Case(
        _phone,
        flags=("--fps", "source"),
        expect={"times": _phone_ms(), "rotation": 90, "frames": PHONE_FRAMES, "streams": [("audio", "aac", "und")]},
        plan={"timing.variable": True, "timing.times_kept": True},
    ),
    "phone-vfr-source-timing-original-audio": Case(
        _phone,
        flags=("--fps", "source", "--audio", "original"),
        expect={"times": _phone_ms(), "streams": [("audio", "aac", "und")], "audio_ends_with_video": True},
    ),
    "phone-vfr-rotated-contract": Case(
        _phone,
        expect={"rate": "24", "rotation": 90, "evenly_timed": True},
        plan={"timing.variable": True, "timing.kept_on_timestamps": True},
    ),
    "29.97-chapters-two-languages": Case(
        broadcast_source_file,
        flags=("--audio", "original", "--fps", "source"),
        expect={
            "rate": "30000/1001",
            "frames": 9,
            "streams": [("audio", "aac", "eng"), ("audio", "aac", "fra")],
            "chapters": ["Part 1", "Part 2", "Part 3"],
        },
        suffix=".mkv",
    ),
    "prores-422-10bit-master": Case(
        lambda p: prores_master(p.parent),
        flags=("--codec", "prores", "--audio", "original"),
        expect={
            "format": "mov",
            "codec": "prores",
            "pix_fmt": "yuv422p10le",
            "colour": "bt709/bt709/bt709/tv",
            "streams": [("audio", "pcm_s24le", "und"), ("subtitle", "mov_text", "eng")],
        },
        suffix=".mkv",
    ),
}


def _probe(path: Path) -> dict[str, object]:
    """What ffprobe says of the output, through PyAV: the container, the video stream's codec, pixel format, size,
    colour tags, pixel and display shape, rotation, frames and their times, and the other streams and chapters."""
    with av.open(str(path)) as container:
        video = container.streams.video[0]
        codec = video.codec_context
        frames = list(container.decode(video))
        times = sorted(frame.pts * video.time_base for frame in frames)
        steps = {b - a for a, b in zip(times, times[1:], strict=False)}
        sar = video.sample_aspect_ratio or Fraction(1)
        end = times[-1] + 1 / video.average_rate if video.duration is None else video.duration * video.time_base
        heard = [a.duration * a.time_base for a in container.streams.audio if a.duration]
        return {
            "format": container.format.name.split(",")[0],
            "codec": codec.codec.canonical_name,
            "pix_fmt": codec.pix_fmt,
            "size": (codec.width, codec.height),
            "colour": ColourTags.of_codes(
                codec.color_primaries, codec.color_trc, codec.colorspace, codec.color_range
            ).describe(),
            "sar": str(sar),
            "dar": str(sar * codec.width / codec.height),
            "rotation": media.probe(path).rotation,
            "frames": len(frames),
            "interlaced": any(frame.interlaced_frame for frame in frames),
            "rate": str(video.average_rate),
            "times": [t - times[0] for t in times],
            # A constant rate's steps differ by the clock's rounding at most.
            "evenly_timed": len(steps) < 2 or max(steps) - min(steps) <= video.time_base,
            "streams": [
                # MP4 writes "und" for a stream of no language.
                (s.type, s.codec_context.name, s.metadata.get("language", "und"))
                for s in container.streams
                if s.index != video.index and s.type != "data"
            ],
            "chapters": [chapter["metadata"].get("title") for chapter in container.chapters()],
            "hdr": None if (hdr := media.probe(path).hdr) is None else hdr.describe(),
            # Within one frame (AAC's last packet may run past the end by part of one).
            "audio_ends_with_video": bool(heard) and all(abs(h - end) < 1 / video.average_rate for h in heard),
        }


def _argv(command: str, source: Path, tmp_path: Path, bundle: Path, flags: tuple[str, ...]) -> list[str]:
    argv = [command, str(source), "--model", str(bundle), "--store", str(tmp_path / "store"), "--scale", "2"]
    if command == "upscale":
        argv += ["-o", str(tmp_path / "out"), "--device", "cpu"]
    return [*argv, *flags]


def _planned(shown: dict, dotted: str) -> object:
    for key in dotted.split("."):
        shown = shown[key]
    return shown


@pytest.mark.parametrize("name", list(CASES))
def test_each_archive_source_through_upscale(
    name: str, tiny_bundle_path: Path, tiny_bundle, tmp_path: Path, capsys, recwarn
) -> None:
    case = CASES[name]
    source = case.make(tmp_path / f"source{case.suffix}")
    if case.refused is not None:
        assert main(_argv("upscale", source, tmp_path, tiny_bundle_path, case.flags)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and case.refused in err and str(source) in err, err
        assert not (tmp_path / "out").exists() and not (tmp_path / "store").exists()
        return
    if case.plan:
        assert main([*_argv("plan", source, tmp_path, tiny_bundle_path, case.flags), "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert {key: _planned(shown, key) for key in case.plan} == case.plan
    assert main(_argv("upscale", source, tmp_path, tiny_bundle_path, case.flags)) == 0
    (output,) = (tmp_path / "out").iterdir()
    seen = _probe(output)
    assert {key: seen[key] for key in case.expect} == case.expect
    if case.pixels:
        # Lossless 4:4:4: only the matrix and two 8-bit roundings stand between the frames and the file, so a file
        # written with one matrix and tagged with another would be off by tens on these saturated pixels.
        params = UpscaleParams(scale=2, crf=0, pix_fmt="yuv444p")
        handed = upscale(source, None, tiny_bundle, params, return_frames=True).frames
        decoded = media.read_frames(output, list(range(len(handed))))
        assert np.abs(decoded.astype(int) - handed.astype(int)).max() <= 3
