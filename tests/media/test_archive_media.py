"""Archive-grade outputs and sources (issue 46): mezzanine and delivery codecs, each in its container, through
`k6vsr upscale` on the tiny model; every source is made here and every output read back through PyAV."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from media_kit import FONT, anamorphic_source, broadcast_source_file, prores_master, smooth_frames

from entrypoints.cli import main
from k6vsr_core import media
from k6vsr_core.contract.params import parse_params
from k6vsr_core.errors import ParameterError
from k6vsr_core.media.encoding import VideoEncoding
from k6vsr_core.media.sample import make_sample_clip

# (encoding, container suffix, codec read back, pixel format read back, profile read back)
MEZZANINE = [
    (VideoEncoding(codec="prores"), ".mov", "prores", "yuv422p10le", "HQ"),
    (VideoEncoding(codec="prores", pix_fmt="yuv444p10le"), ".mov", "prores", "yuv444p10le", "4444"),
    (VideoEncoding(codec="prores", pix_fmt="yuva444p10le"), ".mov", "prores", "yuva444p10le", "4444"),
    (VideoEncoding(codec="dnxhr"), ".mov", "dnxhd", "yuv422p10le", "DNXHR HQX"),
    (VideoEncoding(codec="av1"), ".mp4", "av1", "yuv420p10le", "Main"),
]
IDS = ["prores-422hq", "prores-4444", "prores-4444-alpha", "dnxhr-hqx", "av1-10bit"]


def _video(path: Path) -> dict[str, object]:
    """What ffprobe would say of the video stream, through PyAV, and its frames decoded as RGB."""
    with av.open(str(path)) as container:
        video = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video)]
        codec = video.codec_context
        return {
            "format": container.format.name,
            "codec": codec.codec.canonical_name,
            # The ProRes decoder gives 4444 as 12-bit from some files (k6vsr_core.media.checking).
            "pix_fmt": codec.pix_fmt.replace("12le", "10le"),
            "profile": codec.profile,
            "tag": codec.codec_tag,
            "colour": (codec.color_primaries, codec.color_trc, codec.colorspace, codec.color_range),
            "frames": np.stack(frames),
            "others": [s.type for s in container.streams if s.index != video.index],
        }


@pytest.mark.parametrize(("encoding", "suffix", "codec", "pix_fmt", "profile"), MEZZANINE, ids=IDS)
def test_segments_of_each_codec_join_by_stream_copy_in_its_container_and_profile(
    tmp_path: Path, encoding: VideoEncoding, suffix: str, codec: str, pix_fmt: str, profile: str
) -> None:
    """A one-frame segment then a longer one, joined as a run joins its windows, with audio; the health check
    passes and the frames are the written ones within the codec's loss."""
    frames = smooth_frames(5, 120, 256)  # DNxHR takes 256x120 at the least
    segments = []
    for index, part in enumerate((frames[:1], frames[1:])):
        segments.append(str(tmp_path / f"{index}{encoding.suffix}"))
        media.write_segment(segments[-1], part, 24, encoding)
    out = tmp_path / f"out{encoding.suffix}"
    media.concat_segments(segments, out, 24, np.zeros(20000, np.float32), len(frames), 0, encoding)
    media.check_output(out, media.planned_output(encoding, len(frames), 24, (120, 256), 20000))
    seen = _video(out)
    assert encoding.suffix == suffix and seen["others"] == ["audio"]
    assert (seen["codec"], seen["pix_fmt"], seen["profile"]) == (codec, pix_fmt, profile)
    assert seen["colour"] == (1, 1, 1, 1)  # BT.709, limited range
    error = np.abs(seen["frames"].astype(int) - frames)  # type: ignore[union-attr]
    # swscale's own RGB to YUV and back costs about 1.5 levels on average (the default H.264 file too).
    assert error.mean() < 2.5 and np.percentile(error, 99) <= 6, (error.mean(), np.percentile(error, 99))


def test_prores_4444_keeps_its_profile_tag_through_the_join(tmp_path: Path) -> None:
    """QuickTime names a ProRes profile by the sample's tag: a plain remux would write 4444 pictures as apch (HQ)."""
    encoding = VideoEncoding(codec="prores", pix_fmt="yuv444p10le")
    segment = str(tmp_path / "0.mov")
    media.write_segment(segment, smooth_frames(2, 32, 32), 24, encoding)
    media.concat_segments([segment], tmp_path / "out.mov", 24, None, 2, 0, encoding)
    assert _video(tmp_path / "out.mov")["tag"] == "ap4h"


def test_av1_encodes_without_printing_svt_av1s_configuration(tmp_path: Path) -> None:
    """Each window's segment starts an encoder; SVT-AV1 would print a dozen lines for each
    (k6vsr_core.device.process_env)."""
    code = (
        "import numpy as np; from k6vsr_core import media; from k6vsr_core.media.encoding import VideoEncoding; "
        f"media.write_video({str(tmp_path / 'a.mp4')!r}, np.zeros((2, 64, 64, 3), np.uint8), 24, None, 0, "
        "VideoEncoding(codec='av1'))"
    )
    env = {key: value for key, value in os.environ.items() if key != "SVT_LOG"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and (tmp_path / "a.mp4").stat().st_size > 0, done.stderr
    assert "Svt[info]" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("values", "flag"),
    [
        ({"codec": "prores", "pix_fmt": "yuv420p"}, "pix_fmt"),
        ({"codec": "dnxhr", "pix_fmt": "yuv444p10le"}, "pix_fmt"),
        ({"codec": "av1", "pix_fmt": "yuv420p"}, "pix_fmt"),
        ({"codec": "h264", "pix_fmt": "yuv422p10le"}, "pix_fmt"),
        ({"codec": "prores", "crf": 10}, "crf"),
        ({"codec": "dnxhr", "preset": "fast"}, "preset"),
        ({"codec": "av1", "crf": 64}, "crf"),
        ({"codec": "av1", "preset": "slow"}, "preset"),
    ],
)
def test_choices_a_codec_does_not_take_are_refused_naming_the_field(values: dict, flag: str) -> None:
    with pytest.raises(ParameterError) as err:
        parse_params(**values)
    message = str(err.value)
    assert message.startswith(flag) and values["codec"] in message and "\n" not in message, message


@pytest.fixture(scope="module")
def source_128x64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One frame of 128x64 with stereo audio: 256x128 at x2, DNxHR's least size and a second of CPU decoding."""
    return make_sample_clip(tmp_path_factory.mktemp("mezzanine") / "clip.mp4", width=128, height=64, num_frames=1)


@pytest.mark.parametrize(("encoding", "suffix", "codec", "pix_fmt", "profile"), MEZZANINE, ids=IDS)
def test_upscale_writes_each_codec_in_its_container_with_the_source_streams(
    tiny_bundle_path: Path,
    source_128x64: Path,
    tmp_path: Path,
    encoding: VideoEncoding,
    suffix: str,
    codec: str,
    pix_fmt: str,
    profile: str,
) -> None:
    """`--audio original` joins the one window's segment by stream copy with the source's audio, as a long clip's
    windows are joined, and the health check reads the file back before it is published."""
    out = tmp_path / "out"
    argv = ["upscale", str(source_128x64), "-o", str(out), "--model", str(tiny_bundle_path)]
    argv += ["--store", str(tmp_path / "store"), "--device", "cpu", "--scale", "2", "--audio", "original"]
    argv += ["--codec", encoding.codec] + (["--pix-fmt", encoding.pix_fmt] if encoding.pix_fmt else [])
    assert main(argv) == 0
    (written,) = out.iterdir()
    assert written.name.startswith("clip_sr2x") and written.suffix == suffix
    seen = _video(written)
    assert (seen["codec"], seen["pix_fmt"], seen["profile"]) == (codec, pix_fmt, profile)
    assert seen["frames"].shape == (1, 128, 256, 3) and seen["others"] == ["audio"]  # type: ignore[union-attr]
    assert seen["colour"] == (1, 1, 1, 1)


def test_plan_shows_the_profile_and_refuses_an_output_too_small_for_dnxhr(
    tiny_bundle_path: Path, source_128x64: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", str(source_128x64), "--model", str(tiny_bundle_path), "--store", str(tmp_path), "--json"]
    assert main([*argv, "--scale", "2", "--codec", "prores", "--pix-fmt", "yuv444p10le"]) == 0
    shown = json.loads(capsys.readouterr().out)["output_format"]
    assert {k: shown[k] for k in ("codec", "encoder", "crf", "pix_fmt", "container", "profile")} == {
        "codec": "prores",
        "encoder": "prores_ks",
        "crf": None,
        "pix_fmt": "yuv444p10le",
        "container": "mov",
        "profile": "4444",
    }
    assert main([*argv, "--scale", "2", "--codec", "dnxhr", "--target-resolution", "128x64"]) == 2
    err = capsys.readouterr().err
    assert "codec=dnxhr needs an output of at least 256x120 pixels, got 128x64" in err, err


# ------------------------------------------------------------------------------------------------ geometry


def _aspect(path: Path) -> tuple[Fraction, Fraction, Fraction | None, tuple[int, int]]:
    """The pixels' shape as ffprobe reports it (the container's, else the stream's), the display aspect ratio it
    gives, the shape in the video stream itself (H.264's header has one, AV1's and ProRes's none), and the size."""
    with av.open(str(path)) as container:
        video = container.streams.video[0]
        next(container.decode(video))
        codec = video.codec_context
        sar = video.sample_aspect_ratio or Fraction(1)
        return sar, sar * codec.width / codec.height, codec.sample_aspect_ratio, (codec.width, codec.height)


# A PAL 4:3 frame (720x576, pixels 16:15) and an NTSC one (720x480, pixels 8:9), each at an eighth of its size.
PAL_4_3 = (90, 72, Fraction(16, 15))
NTSC_4_3 = (90, 60, Fraction(8, 9))


def _upscale(source: Path, tmp_path: Path, bundle: Path, *extra: str) -> Path:
    out = tmp_path / "out"
    argv = ["upscale", str(source), "-o", str(out), "--model", str(bundle), "--store", str(tmp_path / "store")]
    assert main([*argv, "--device", "cpu", "--scale", "2", *extra]) == 0
    (written,) = out.iterdir()
    return written


@pytest.mark.parametrize(
    ("geometry", "flags"),
    [
        (PAL_4_3, ()),
        (NTSC_4_3, ()),
        (PAL_4_3, ("--codec", "prores", "--audio", "original")),
        (NTSC_4_3, ("--codec", "av1", "--audio", "original")),
    ],
    ids=["pal-h264", "ntsc-h264", "pal-prores-joined", "ntsc-av1-joined"],
)
def test_a_4_3_source_of_non_square_pixels_comes_back_4_3_uncropped(
    tiny_bundle_path: Path, tmp_path: Path, geometry: tuple[int, int, Fraction], flags: tuple[str, ...]
) -> None:
    width, height, sar = geometry
    source = anamorphic_source(tmp_path / "tape.mp4", width, height, sar)
    assert _aspect(source)[:2] == (sar, Fraction(4, 3))
    written = _upscale(source, tmp_path, tiny_bundle_path, *flags)
    container_sar, dar, stream_sar, size = _aspect(written)
    assert size == (2 * width, 2 * height)  # nothing cropped, nothing resampled to square
    assert (container_sar, dar) == (sar, Fraction(4, 3))
    if not flags:
        assert stream_sar == sar  # in H.264's own header too


def test_ffv1_of_non_square_pixels_is_refused_before_any_work(tiny_bundle_path: Path, tmp_path: Path, capsys) -> None:
    """Matroska would need its display size set, which PyAV cannot: the picture would play stretched."""
    source = anamorphic_source(tmp_path / "tape.mp4", *PAL_4_3)
    argv = ["upscale", str(source), "-o", str(tmp_path / "out"), "--model", str(tiny_bundle_path)]
    assert main([*argv, "--store", str(tmp_path / "store"), "--scale", "2", "--codec", "ffv1"]) == 2
    err = capsys.readouterr().err
    assert "codec=ffv1 writes Matroska, which cannot be given this output's pixel shape (16/15, for a 4/3" in err
    assert not (tmp_path / "out").exists()


def test_an_exact_target_of_the_display_shape_gives_square_pixels(tiny_bundle_path: Path, tmp_path: Path) -> None:
    """Resized to 4:3 on the whole picture, the same 4:3 needs square pixels: no ratio is written."""
    source = anamorphic_source(tmp_path / "tape.mp4", *PAL_4_3)
    written = _upscale(
        source, tmp_path, tiny_bundle_path, "--target-resolution", "160x120", "--target-resize-mode", "exact"
    )
    container_sar, _, stream_sar, size = _aspect(written)
    assert size == (160, 120) and container_sar == 1 and stream_sar in (None, 1)


def test_plan_states_the_aspect_kept_for_a_full_size_pal_frame(
    tiny_bundle_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan computes nothing, so the real 720x576 frame is cheap here: 1440x1152 at x2, still 4:3 on screen."""
    source = anamorphic_source(tmp_path / "tape.mp4", 720, 576, Fraction(16, 15))
    argv = ["plan", str(source), "--model", str(tiny_bundle_path), "--store", str(tmp_path), "--scale", "2"]
    assert main([*argv, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["output_size"] == {"width": 1440, "height": 1152}
    assert shown["aspect"] == {
        "source_sample_aspect": "16/15",
        "source_display_aspect": "4/3",
        "sample_aspect": "16/15",
        "display_aspect": "4/3",
        "pixels": "non-square, as the source's: the ratio is written, not resampled",
    }
    assert main(argv) == 0
    assert "aspect    4/3 on screen from pixels of 16/15 (non-square" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ chapters


@pytest.fixture(scope="module")
def broadcast_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """0.3 s of 29.97 fps 64x48 in Matroska: English stereo and French mono audio, four chapters (the last starts
    after the end, the third runs past it) and a font attachment."""
    return broadcast_source_file(tmp_path_factory.mktemp("broadcast") / "episode.mkv")


def _chapters(path: Path) -> list[tuple[str, float, float]]:
    with av.open(str(path)) as container:
        return [
            (c["metadata"].get("title", ""), float(c["start"] * c["time_base"]), float(c["end"] * c["time_base"]))
            for c in container.chapters()
        ]


def _carried(path: Path) -> tuple[list[tuple[str, object]], dict[str, bytes], float]:
    """The audio streams' languages and channels, the attachments by name, and the video's span in seconds."""
    with av.open(str(path)) as container:
        video = container.streams.video[0]
        frames = sum(1 for _ in container.decode(video))
        audio = [(a.metadata.get("language"), a.codec_context.channels) for a in container.streams.audio]
        attached = {s.name: bytes(s.data) for s in container.streams if s.type == "attachment"}
        return audio, attached, frames / float(video.average_rate)


@pytest.mark.parametrize(("codec", "attached"), [("h264", False), ("prores", False), ("ffv1", True)])
def test_original_keeps_chapters_cut_to_the_output_and_attachments_where_the_container_holds_them(
    tiny_bundle_path: Path, broadcast_source: Path, tmp_path: Path, codec: str, attached: bool, capsys
) -> None:
    written = _upscale(broadcast_source, tmp_path, tiny_bundle_path, "--audio", "original", "--codec", codec)
    audio, attachments, span = _carried(written)
    assert audio == [("eng", 2), ("fra", 1)]
    assert span == pytest.approx(0.3, abs=0.05)
    chapters = _chapters(written)
    assert [title for title, _, _ in chapters] == ["Part 1", "Part 2", "Part 3"]
    times = [time for _, start, end in chapters for time in (start, end)]
    assert times == pytest.approx([0.0, 0.1, 0.1, 0.2, 0.2, span], abs=0.002)
    if attached:
        assert attachments == {"font.ttf": FONT}
    else:
        assert attachments == {}
        assert "attachment 'font.ttf' (application/x-truetype-font) is left out" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ mezzanine sources


@pytest.fixture(scope="module")
def prores_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A post-production master: one frame of 10-bit 4:2:2 ProRes 422 HQ, 64x48, with 24-bit stereo PCM and an
    English SubRip subtitle, in Matroska (which holds all three as they are)."""
    return prores_master(tmp_path_factory.mktemp("master"))


def test_a_prores_master_comes_back_as_prores_with_its_pcm_as_it_is_and_its_subtitles(
    tiny_bundle_path: Path, prores_source: Path, tmp_path: Path
) -> None:
    with av.open(str(prores_source)) as source:
        assert source.streams.video[0].codec_context.pix_fmt == "yuv422p10le"
    written = _upscale(prores_source, tmp_path, tiny_bundle_path, "--audio", "original", "--codec", "prores")
    with av.open(str(written)) as container:
        kinds = [(s.type, s.codec_context.name, s.metadata.get("language")) for s in container.streams]
        assert container.format.name.startswith("mov")
    assert kinds[0][:2] == ("video", "prores")
    assert kinds[1][:2] == ("audio", "pcm_s24le") and kinds[2] == ("subtitle", "mov_text", "eng")
