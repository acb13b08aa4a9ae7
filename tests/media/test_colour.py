"""Colour (issue #46, item 1): a source's tags and HDR metadata read, carried to the output and its health check, or
the source refused with the reason; on synthetic sources made here with PyAV. The 16-bit path that HDR sources take
through the model: tests/media/test_hdr.py."""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from media_kit import PATCH, colour_source, hdr_source

from entrypoints.cli import main
from k6vsr_core import media
from k6vsr_core.errors import UnsupportedColour
from k6vsr_core.media.checking import ColourTags
from k6vsr_core.media.encoding import VideoEncoding
from k6vsr_core.model.bundle import model_traits


# A Rec. 2020 mastering display of 1000 cd/m² (x265's units: 0.00002 for xy, 0.0001 cd/m² for luminance).
def _tags(primaries: str, transfer: str, matrix: str, range_: str = "tv") -> ColourTags:
    return ColourTags(primaries=primaries, transfer=transfer, matrix=matrix, range=range_)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("colour")
    return {
        "hdr10": hdr_source(folder / "hdr10.mp4", "smpte2084"),
        "hlg": hdr_source(folder / "hlg.mp4", "arib-std-b67"),
        "bt2020_sdr": colour_source(folder / "bt2020.mp4", _tags("bt2020", "bt709", "bt2020nc")),
        "ntsc": colour_source(folder / "ntsc.mp4", _tags("smpte170m", "smpte170m", "smpte170m")),
        "pal_full": colour_source(folder / "pal.mp4", _tags("bt470bg", "gamma28", "bt470bg", "pc")),
        "untagged": colour_source(folder / "untagged.mp4", _tags("unspecified", "unspecified", "unspecified")),
    }


# ------------------------------------------------------------------------------------------------ reading


def test_probe_reads_the_tags_depth_and_hdr_metadata_of_an_hdr10_source(sources: dict[str, Path]) -> None:
    probe = media.probe(sources["hdr10"])
    assert probe.colour == _tags("bt2020", "smpte2084", "bt2020nc")
    assert probe.bit_depth == 10 and probe.pix_fmt == "yuv420p10le"
    assert probe.hdr is not None and probe.hdr.mastering is not None and probe.hdr.light is not None
    mastering = probe.hdr.mastering
    assert mastering.green == (Fraction(8500, 50000), Fraction(39850, 50000))
    assert mastering.red == (Fraction(35400, 50000), Fraction(14600, 50000))
    assert mastering.white == (Fraction(3127, 10000), Fraction(329, 1000))
    assert (mastering.min_luminance, mastering.max_luminance) == (Fraction(1, 200), 1000)
    assert (probe.hdr.light.max_cll, probe.hdr.light.max_fall) == (1000, 400)


def test_probe_reads_bt601_and_untagged_sources_as_they_are(sources: dict[str, Path]) -> None:
    assert media.probe(sources["ntsc"]).colour == _tags("smpte170m", "smpte170m", "smpte170m")
    assert media.probe(sources["pal_full"]).colour == _tags("bt470bg", "gamma28", "bt470bg", "pc")
    untagged = media.probe(sources["untagged"])
    assert untagged.colour.matrix == "unspecified" and untagged.bit_depth == 8 and untagged.hdr is None


# ------------------------------------------------------------------------------------------------ the output's tags


@pytest.mark.parametrize(
    ("source", "written"),
    [
        (_tags("unspecified", "unspecified", "unspecified"), media.BT709_TV),
        (_tags("bt709", "bt709", "bt709"), media.BT709_TV),
        (_tags("unspecified", "unspecified", "gbr", "pc"), media.BT709_TV),
        (_tags("smpte170m", "smpte170m", "smpte170m"), _tags("smpte170m", "smpte170m", "smpte170m")),
        (_tags("unspecified", "unspecified", "bt470bg"), _tags("bt470bg", "smpte170m", "bt470bg")),
        (_tags("bt470bg", "gamma28", "bt470bg", "pc"), _tags("bt470bg", "gamma28", "bt470bg")),
        (_tags("smpte170m", "bt709", "bt709"), _tags("smpte170m", "bt709", "bt709")),
    ],
)
def test_sdr_sources_keep_their_tags_and_come_out_limited_range(source: ColourTags, written: ColourTags) -> None:
    assert media.output_colour("clip.mp4", source) == written


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        (_tags("bt2020", "smpte2084", "bt2020nc"), "HDR10 (PQ, smpte2084)"),
        (_tags("bt2020", "arib-std-b67", "bt2020nc"), "HLG (arib-std-b67)"),
        (_tags("bt709", "smpte2084", "bt709"), "HDR10"),
        (_tags("bt2020", "bt709", "bt2020nc"), "BT.2020 wide-gamut"),
        (_tags("bt709", "bt709", "bt2020c"), "BT.2020 wide-gamut"),
        (_tags("bt709", "bt709", "smpte240m"), "matrix smpte240m"),
        (_tags("smpte240m", "bt709", "bt709"), "primaries smpte240m"),
        (_tags("bt709", "linear", "bt709"), "transfer linear"),
    ],
)
def test_colours_the_8_bit_path_cannot_carry_are_refused_with_the_reason(source: ColourTags, reason: str) -> None:
    with pytest.raises(UnsupportedColour, match=re.escape(reason)) as caught:
        media.output_colour("clip.mp4", source)
    assert caught.value.path == "clip.mp4" and source.describe() in str(caught.value)


def test_hdr_metadata_on_an_sdr_tagged_stream_is_refused(sources: dict[str, Path]) -> None:
    hdr = media.probe(sources["hdr10"]).hdr
    with pytest.raises(UnsupportedColour, match="mastering or content-light metadata"):
        media.output_colour("clip.mp4", media.BT709_TV, hdr)


# ------------------------------------------------------------------------------------------------ media round trip


@pytest.mark.parametrize("name", ["ntsc", "pal_full"])
def test_a_bt601_patch_comes_back_with_its_tags_and_colour(name: str, sources: dict[str, Path], tmp_path: Path) -> None:
    """Read with its own matrix and range, written with its matrix and tags: the patch decodes within 3 of 255 of
    what was read (swscale's 8-bit rounding, once each way), and the health check finds the planned tags."""
    probe = media.probe(sources[name])
    colour = media.output_colour(probe.path, probe.colour, probe.hdr)
    frames = media.read_frames(sources[name], [0])
    out = tmp_path / "out.mp4"
    media.write_video(out, frames, 24, None, colour=colour)
    planned = media.planned_output(VideoEncoding(), 1, 24, frames.shape[1:3], colour=colour)
    media.check_output(out, planned)
    assert media.probe(out).colour == colour
    back = media.read_frames(out, [0])[0].astype(int)
    assert np.abs(back - frames[0]).max() <= 3


# ------------------------------------------------------------------------------------------------ through `k6vsr`


def _upscale(source: Path, tmp_path: Path, bundle: Path, command: str = "upscale") -> list[str]:
    argv = [command, str(source), "--model", str(bundle), "--store", str(tmp_path / "store")]
    if command == "upscale":
        argv += ["-o", str(tmp_path / "out"), "--device", "cpu", "--scale", "2"]
    return argv


# HDR10 and HLG sources through `k6vsr upscale` at 10 bits, and what is refused there: tests/media/test_hdr.py.


def test_upscale_writes_a_bt601_source_with_its_tags(
    sources: dict[str, Path], tiny_bundle_path: Path, tmp_path: Path
) -> None:
    assert main(_upscale(sources["ntsc"], tmp_path, tiny_bundle_path)) == 0
    (output,) = (tmp_path / "out").glob("*.mp4")
    with av.open(str(output)) as container:
        context = container.streams.video[0].codec_context
        seen = ColourTags.of_codes(context.color_primaries, context.color_trc, context.colorspace, context.color_range)
    assert seen == _tags("smpte170m", "smpte170m", "smpte170m")


def test_plan_says_the_source_colour_and_the_colour_written(
    sources: dict[str, Path], tiny_bundle_path: Path, tmp_path: Path, capsys
) -> None:
    argv = _upscale(sources["pal_full"], tmp_path, tiny_bundle_path, "plan")
    assert main([*argv, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["source_colour"] == "bt470bg/gamma28/bt470bg/pc, 8-bit"
    assert shown["output_format"]["colour"] == "bt470bg/gamma28/bt470bg/tv"
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "colour bt470bg/gamma28/bt470bg/pc, 8-bit" in lines[0]
    assert lines[3].startswith("output ") and "colour bt470bg/gamma28/bt470bg/tv" in lines[3]


# ------------------------------------------------------------------------------------------------ 10-bit media path


def _yuv_planes(path: Path) -> np.ndarray:
    """The first frame's 10-bit code values as stored (Y, then U and V), no colour conversion."""
    with av.open(str(path)) as container:
        frame = next(container.decode(video=0))
        assert frame.format.name == "yuv420p10le"
        return frame.to_ndarray().astype(int)


@pytest.mark.parametrize("name", ["hdr10", "hlg"])
def test_an_hdr_patch_comes_back_within_one_code_value_through_the_16_bit_media_path(
    name: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    """A BT.2020 PQ or HLG source read as 16-bit RGB and written as HEVC main10 with its tags and metadata: every
    stored 10-bit code value (Y, U and V) within 1 of the source's, where 8-bit RGB in between is off by more."""
    source = sources[name]
    probe = media.probe(source)
    encoding = VideoEncoding(codec="hevc", pix_fmt="yuv420p10le")
    # Three frames: x265 (as in PyAV's wheels) sometimes gives a one- or two-frame stream an uninitialised dts.
    frames = np.repeat(media.read_frames(source, [0], depth=16), 3, axis=0)
    assert frames.dtype == np.uint16
    out = tmp_path / "out.mp4"
    media.write_video(out, frames, 24, None, encoding=encoding, colour=probe.colour, hdr=probe.hdr)
    written = media.probe(out)
    assert (written.colour, written.bit_depth, written.hdr) == (probe.colour, 10, probe.hdr)
    assert np.abs(_yuv_planes(out) - _yuv_planes(source)).max() <= 1

    eight = np.repeat(media.read_frames(source, [0]), 3, axis=0).astype(np.uint16) * 257
    media.write_video(out, eight, 24, None, encoding=encoding, colour=probe.colour, hdr=probe.hdr)
    assert np.abs(_yuv_planes(out) - _yuv_planes(source)).max() > 1


def test_16_bit_frames_are_not_written_as_8_bits(tmp_path: Path) -> None:
    frames = np.zeros((1, 16, 16, 3), np.uint16)
    with pytest.raises(ValueError, match="16-bit frames need a 10-bit pixel format"):
        media.write_video(tmp_path / "out.mp4", frames, 24, None)
    assert not (tmp_path / "out.mp4").exists()


def test_joined_segments_keep_a_bt601_colour(sources: dict[str, Path], tmp_path: Path) -> None:
    """A run of several windows joins its segments by stream copy: the tags come with the packets."""
    colour = _tags("bt470bg", "smpte170m", "bt470bg")
    frames = np.repeat(media.read_frames(sources["pal_full"], [0]), 4, axis=0)
    parts = [str(tmp_path / "0.mp4"), str(tmp_path / "1.mp4")]
    for part, half in zip(parts, (frames[:2], frames[2:]), strict=True):
        media.write_segment(part, half, 24, colour=colour)
    out = tmp_path / "out.mp4"
    media.concat_segments(parts, out, 24, None, 4)
    media.check_output(out, media.planned_output(VideoEncoding(), 4, 24, frames.shape[1:3], colour=colour))


def test_the_http_api_answers_a_refused_colour_with_its_own_code() -> None:
    from entrypoints.server.error_table import user_answer

    assert user_answer(UnsupportedColour("clip.mp4", "HDR10")) == (400, "unsupported_colour")


def test_the_model_sees_a_bt601_sources_code_values_and_its_output_decodes_as_handed_to_the_encoder(
    sources: dict[str, Path], tiny_bundle, tmp_path: Path
) -> None:
    """What goes in: the source's RGB decoded with its own matrix (the patch within 3 of 255); what comes out: the
    frames the pipeline handed to the encoder, within 3, decoded by a player that follows the output's tags (written
    with BT.709's matrix instead, saturated pixels would be off by tens)."""
    from k6vsr_core import UpscaleParams, upscale
    from k6vsr_core.model.runner import read_source, read_window

    clip = read_source(sources["ntsc"], UpscaleParams(scale=2), model_traits(tiny_bundle.info))
    assert clip.plan.colour == _tags("smpte170m", "smpte170m", "smpte170m")
    seen = read_window(clip, clip.plan.windows[0]).astype(int)
    assert np.abs(seen[:, 8:-8, 8:-8] - PATCH).max() <= 3

    out = tmp_path / "out.mp4"
    # Lossless 4:4:4, so that only the matrix and the two 8-bit roundings stand between the frames and the file.
    params = UpscaleParams(scale=2, crf=0, pix_fmt="yuv444p")
    result = upscale(sources["ntsc"], out, tiny_bundle, params, return_frames=True)
    assert media.probe(out).colour == clip.plan.colour
    assert np.abs(media.read_frames(out, [0]).astype(int) - result.frames.astype(int)).max() <= 3
