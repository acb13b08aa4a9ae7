"""HDR and 10-bit sources through the model (issue #46, item 1): a source of more than 8 bits goes to a 10-bit
output at 16 bits a sample from its decode to the encoder, never 8; PQ, HLG and BT.2020 sources keep their tags and
their mastering-display and content-light metadata; what cannot be carried is refused with the reason, nothing
written. On synthetic sources made here with PyAV (`media_kit`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from media_kit import colour_source, hdr_source

from entrypoints.cli import main
from k6vsr_core import UpscaleParams, media, upscale
from k6vsr_core.contract.windows import crossfade
from k6vsr_core.errors import UnsupportedColour
from k6vsr_core.media.checking import ColourTags
from k6vsr_core.media.encoding import VideoEncoding
from k6vsr_core.media.hdr import hdr_differences
from k6vsr_core.model import stages
from k6vsr_core.model.pixels import TileBlender

HDR10 = ColourTags(primaries="bt2020", transfer="smpte2084", matrix="bt2020nc", range="tv")
HLG = ColourTags(primaries="bt2020", transfer="arib-std-b67", matrix="bt2020nc", range="tv")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hdr")
    return {
        "hdr10": hdr_source(folder / "hdr10.mp4", "smpte2084", frames=3),
        "hlg": hdr_source(folder / "hlg.mp4", "arib-std-b67", frames=3),
        # As broadcast HLG comes: no mastering metadata.
        "hlg_plain": colour_source(
            folder / "hlg_plain.mp4", HLG, codec="libx265", pix_fmt="yuv420p10le", size=media.HEVC_MIN_SIDE, frames=3
        ),
        # Two shots of five frames: two windows, two segments joined by stream copy.
        "hdr10_two_shots": hdr_source(folder / "two_shots.mp4", "smpte2084", frames=10, cut_at=5),
        "bt2020_8bit": colour_source(
            folder / "bt2020_8bit.mp4", ColourTags(primaries="bt2020", transfer="bt709", matrix="bt2020nc", range="tv")
        ),
    }


def _argv(command: str, source: Path, tmp_path: Path, bundle: Path, *flags: str) -> list[str]:
    argv = [command, str(source), "--model", str(bundle), "--store", str(tmp_path / "store"), "--scale", "2"]
    if command == "upscale":
        argv += ["-o", str(tmp_path / "out"), "--device", "cpu"]
    return [*argv, *flags]


def _output(tmp_path: Path) -> Path:
    (output,) = (tmp_path / "out").iterdir()
    return output


# ------------------------------------------------------------------------------------------------ the conversion


def test_every_16_bit_value_comes_back_exactly_through_the_model_s_input_and_output_conversion() -> None:
    """The stated conversion: v / (128 * 257) - 1 in, ((y + 1) * 128 / 255) * 65535 rounded out. With the model in
    between left out, every one of the 65,536 values comes back as it was; the contract's 8-bit conversion, which
    truncates, loses up to one level of 256 instead."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.uint16).reshape(1, 1, 256, 256)
    model_input = stages.to_model_input(every)
    assert model_input.min() == -1.0 and model_input.max() < 1.0  # the range the contract's 8 bits give it
    assert torch.equal(stages.to_pixels(model_input, depth=16), every)

    levels = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    back = stages.to_pixels(stages.to_model_input(levels)).int()
    assert (levels.int() - back).abs().max() <= 1


@pytest.mark.parametrize("name", ["hdr10", "hlg"])
def test_a_known_hdr_colour_round_trips_within_one_10_bit_code_value(
    name: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    """The source's flat patch read at 16 bits, through the model's conversion both ways, written as 10-bit HEVC with
    the source's tags: every stored Y, U and V code value within 1 of the source's."""
    source = sources[name]
    probe = media.probe(source)
    frames = media.read_frames(source, [0, 1, 2], depth=16)
    video = stages.frames_to_tensor(frames)
    back = stages.to_pixels(stages.to_model_input(video), depth=16)
    assert torch.equal(back, video)
    out = tmp_path / "out.mp4"
    encoding = VideoEncoding(codec="hevc", pix_fmt="yuv420p10le")
    media.write_video(out, back.permute(0, 2, 3, 1).numpy(), 24, None, encoding=encoding, colour=probe.colour)
    assert np.abs(_planes(out) - _planes(source)).max() <= 1


def _planes(path: Path) -> np.ndarray:
    with av.open(str(path)) as container:
        frame = next(container.decode(video=0))
        assert frame.format.name == "yuv420p10le"
        return frame.to_ndarray().astype(int)


def test_the_pixel_stages_keep_16_bit_pixels_16_bit() -> None:
    """Pre-upscale, padding, blending, resizing and the cross-fade give uint16 for uint16, within their range."""
    from k6vsr_core.contract.tiling import tile_grid
    from k6vsr_core.model.pixels import pad_video, pre_upscale_video, resize_video

    clip = torch.full((2, 3, 16, 16), 65535, dtype=torch.int32).to(torch.uint16)
    assert pre_upscale_video(clip).dtype == torch.uint16 and int(pre_upscale_video(clip).int().max()) == 65535
    assert pad_video(clip, (20, 20)).dtype == torch.uint16
    assert resize_video(clip.permute(1, 0, 2, 3), (8, 8)).dtype == torch.uint16

    grid = tile_grid(64, 64, 2, 16, ((64, 64),))
    blender = TileBlender(grid, 1)
    tile = torch.full((3, 1, *grid.base), 40000, dtype=torch.int32).to(torch.uint16)
    for index in range(grid.num_tiles):
        blender.add(index, tile)
    blended = blender.result()
    assert blended.dtype == torch.uint16 and set(blended.int().unique().tolist()) <= {39999, 40000}
    mixed = TileBlender(grid, 1)
    mixed.add(0, tile)
    with pytest.raises(ValueError, match="is torch.uint8, the tiles before it torch.uint16"):
        mixed.add(1, tile.to(torch.uint8))

    earlier = np.full((3, 2, 2, 3), 1000, np.uint16)
    faded = crossfade(earlier, np.full((3, 2, 2, 3), 65535, np.uint16))
    assert faded.dtype == np.uint16 and faded.max() <= 65535 and faded.min() > 1000
    with pytest.raises(ValueError, match="cannot cross-fade"):
        crossfade(earlier, earlier.astype(np.uint8))


# ------------------------------------------------------------------------------------------------ through `k6vsr`


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "flags", "codec", "pix_fmt"),
    [
        ("hdr10", (), "h264", "yuv420p10le"),
        ("hdr10", ("--codec", "hevc"), "hevc", "yuv420p10le"),
        ("hdr10", ("--codec", "av1"), "av1", "yuv420p10le"),
        ("hlg", ("--codec", "hevc", "--pix-fmt", "yuv444p10le"), "hevc", "yuv444p10le"),
    ],
)
def test_upscale_writes_an_hdr_source_at_10_bits_with_its_tags_and_metadata(
    name: str,
    flags: tuple[str, ...],
    codec: str,
    pix_fmt: str,
    sources: dict[str, Path],
    tiny_bundle_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = sources[name]
    probe = media.probe(source)
    assert main([*_argv("plan", source, tmp_path, tiny_bundle_path, *flags), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["output_format"]
    assert (planned["pixel_depth"], planned["pix_fmt"], planned["colour"]) == (16, pix_fmt, probe.colour.describe())
    assert probe.hdr is not None and planned["hdr_metadata"] == probe.hdr.describe()
    assert main(_argv("plan", source, tmp_path, tiny_bundle_path, *flags)) == 0
    assert any(line.startswith("pixels    16 bits") for line in capsys.readouterr().out.splitlines())

    assert main(_argv("upscale", source, tmp_path, tiny_bundle_path, *flags)) == 0
    written = media.probe(_output(tmp_path))
    assert (written.colour, written.bit_depth, written.pix_fmt, written.num_frames) == (probe.colour, 10, pix_fmt, 3)
    assert written.hdr is not None and hdr_differences(written.hdr, probe.hdr) == []
    with av.open(str(_output(tmp_path))) as container:
        assert container.streams.video[0].codec_context.codec.canonical_name == codec


@pytest.mark.slow
def test_the_frames_handed_to_the_encoder_are_16_bit_and_the_file_holds_them_within_a_10_bit_step(
    sources: dict[str, Path], tiny_bundle, tmp_path: Path
) -> None:
    """The in-memory runner's frames of an HLG source: uint16, most of them between two of the 256 8-bit levels
    (an 8-bit stage anywhere would leave every one on a level); the lossless 10-bit 4:4:4 FFV1 file, tagged HLG,
    decodes to them within the YUV matrix's rounding at 10 bits (3 code values, 3 * 64 of 65536)."""
    params = UpscaleParams(scale=2, codec="ffv1")
    out = tmp_path / "out.mkv"
    handed = upscale(sources["hlg_plain"], out, tiny_bundle, params, return_frames=True).frames
    written = media.probe(out)
    assert (written.colour, written.pix_fmt) == (HLG, "yuv444p10le")
    assert handed.dtype == np.uint16 and (handed % 257 != 0).mean() > 0.9
    decoded = media.read_frames(out, [0, 1, 2], depth=16)
    assert np.abs(decoded.astype(int) - handed.astype(int)).max() <= 3 * 64


@pytest.mark.slow
def test_two_windows_of_an_hdr_source_join_with_the_metadata_and_give_the_in_memory_runner_s_bytes(
    sources: dict[str, Path], tiny_bundle, tiny_bundle_path: Path, tmp_path: Path
) -> None:
    """Two shots, so two windows: two 10-bit segments joined by stream copy keep the tags and the metadata (the
    health check before publish reads them), and the orchestrated command writes the same bytes as the in-memory
    runner."""
    source = sources["hdr10_two_shots"]
    assert main(_argv("upscale", source, tmp_path, tiny_bundle_path)) == 0
    output = _output(tmp_path)
    reference = tmp_path / "reference.mp4"
    result = upscale(source, reference, tiny_bundle, UpscaleParams(scale=2))
    assert result.plan.num_windows == 2 and result.plan.depth == 16
    assert output.read_bytes() == reference.read_bytes()
    written = media.probe(output)
    assert (written.colour, written.bit_depth, written.num_frames) == (HDR10, 10, 10)
    assert hdr_differences(written.hdr, media.probe(source).hdr) == []


# ------------------------------------------------------------------------------------------------ refused


@pytest.mark.parametrize(
    ("name", "flags", "reason"),
    [
        ("hdr10", ("--pix-fmt", "yuv420p"), "pix_fmt=yuv420p is 8-bit"),
        ("hlg", ("--codec", "prores"), "cannot be written with codec=prores"),
        ("hdr10", ("--codec", "ffv1", "--pix-fmt", "gbrp10le"), "writes RGB without colour tags"),
        ("bt2020_8bit", (), "the source is 8-bit"),
    ],
)
def test_what_cannot_be_carried_is_refused_with_the_reason_and_nothing_is_written(
    name: str,
    flags: tuple[str, ...],
    reason: str,
    sources: dict[str, Path],
    tiny_bundle_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for command in ("plan", "upscale"):
        assert main(_argv(command, sources[name], tmp_path, tiny_bundle_path, *flags)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and reason in err and str(sources[name]) in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "store").exists()


@pytest.mark.parametrize(
    "source", [HDR10, HLG, ColourTags(primaries="bt2020", transfer="bt2020-10", matrix="bt2020nc", range="tv")]
)
def test_the_16_bit_path_keeps_pq_hlg_and_bt2020_tags(source: ColourTags) -> None:
    assert media.output_colour("clip.mp4", source, None, eight_bit=None) == source


def test_the_constant_luminance_bt2020_matrix_is_refused_on_any_path() -> None:
    tags = ColourTags(primaries="bt2020", transfer="bt2020-10", matrix="bt2020c", range="tv")
    with pytest.raises(UnsupportedColour, match=re.escape("constant-luminance matrix (bt2020c)")):
        media.output_colour("clip.mp4", tags, None, eight_bit=None)


def test_a_10_bit_sdr_source_asked_for_an_8_bit_output_runs_at_8_bits(sources: dict[str, Path]) -> None:
    """The one way to 8 bits from a 10-bit source: asking for an 8-bit pixel format. A BT.709 10-bit source is then
    read at 8 bits, as before this path existed; left to the default, it runs at 16."""
    from k6vsr_core.contract.source import pixel_path

    probe = media.probe(sources["hdr10"]).model_copy(
        update={"colour": ColourTags(primaries="bt709", transfer="bt709", matrix="bt709", range="tv"), "hdr": None}
    )
    assert pixel_path("clip.mp4", probe, UpscaleParams(pix_fmt="yuv420p")).depth == 8
    assert pixel_path("clip.mp4", probe, UpscaleParams()).depth == 16
    assert pixel_path("clip.mp4", probe, UpscaleParams(codec="prores")).depth == 16
