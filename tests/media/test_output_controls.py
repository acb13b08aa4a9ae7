"""Output and input controls: codec, quality, pixel format, audio, frame rate; each checked as written."""

from __future__ import annotations

import json
import warnings
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from entrypoints.cli import main
from k6vsr_core import UpscaleParams, media, upscale
from k6vsr_core.contract.params import parse_params
from k6vsr_core.contract.plan import make_plan
from k6vsr_core.contract.windows import segment_frames
from k6vsr_core.errors import MediaError, ParameterError
from k6vsr_core.media.encoding import VideoEncoding
from k6vsr_core.media.hdr import ContentLight, HdrMetadata
from k6vsr_core.media.sample import make_sample_clip
from k6vsr_core.model import stages
from k6vsr_core.model.bundle import ModelBundle, model_traits
from k6vsr_core.model.runner import read_source, read_window
from storage import run_key

NTSC = Fraction(30000, 1001)


def _streams(path: Path) -> dict[str, object]:
    """What ffprobe would say, through PyAV."""
    with av.open(str(path)) as container:
        video = container.streams.video[0]
        return {
            "format": container.format.name,
            "codec": video.codec_context.name,
            "pix_fmt": video.codec_context.pix_fmt,
            "frames": sum(1 for _ in container.decode(video)),
            "audio": [
                (
                    a.codec_context.name,
                    a.codec_context.sample_rate,
                    a.codec_context.channels,
                    a.metadata.get("language"),
                )
                for a in container.streams.audio
            ],
            "subtitles": [s.metadata.get("language") for s in container.streams.subtitles],
            "metadata": dict(container.metadata),
        }


def _decode(path: Path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


@pytest.fixture(scope="module")
def frames() -> np.ndarray:
    # x265 needs 128 px a side (media.HEVC_MIN_SIDE).
    return np.random.default_rng(7).integers(0, 256, (10, 128, 144, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def subtitled_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Matroska clip (24 frames at 24 fps) with stereo 48 kHz French audio, English subtitles and a title."""
    folder = tmp_path_factory.mktemp("subtitled")
    srt = folder / "subs.srt"
    srt.write_text("1\n00:00:00,000 --> 00:00:00,400\nHello\n\n2\n00:00:00,500 --> 00:00:00,900\nWorld\n\n")
    path = folder / "source.mkv"
    with av.open(str(srt)) as subs, av.open(str(path), "w", format="matroska") as out:
        out.metadata["title"] = "My clip"
        video = out.add_stream("libx264", rate=24)
        video.width, video.height, video.pix_fmt = 64, 64, "yuv420p"
        sound = out.add_stream("aac", rate=48000, layout="stereo")
        sound.metadata["language"] = "fra"
        text = out.add_stream_from_template(subs.streams[0])
        text.metadata["language"] = "eng"
        for index, image in enumerate(np.random.default_rng(1).integers(0, 256, (24, 64, 64, 3), dtype=np.uint8)):
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts, frame.time_base = index, Fraction(1, 24)
            out.mux(video.encode(frame))
        out.mux(video.encode(None))
        t = np.arange(48000) / 48000
        tone = np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)]).astype(np.float32) * 0.3
        samples = av.AudioFrame.from_ndarray(tone, format="fltp", layout="stereo")
        samples.sample_rate, samples.pts, samples.time_base = 48000, 0, Fraction(1, 48000)
        out.mux(sound.encode(samples))
        out.mux(sound.encode(None))
        for packet in subs.demux(subs.streams[0]):
            if packet.size:
                packet.stream = text
                out.mux(packet)
    return path


# ------------------------------------------------------------------------------------------------ the request


@pytest.mark.parametrize(
    ("values", "flag"),
    [
        ({"codec": "vp9"}, "codec"),
        ({"codec": "ffv1", "crf": 10}, "crf"),
        ({"codec": "ffv1", "preset": "slow"}, "preset"),
        ({"crf": 60}, "crf"),
        ({"preset": "warp"}, "preset"),
        ({"pix_fmt": "rgb48"}, "pix_fmt"),
        ({"audio": "/no/such/file.wav"}, "audio"),
        ({"fps_mode": "double"}, "fps_mode"),
    ],
)
def test_invalid_choices_are_refused_naming_the_field(values: dict, flag: str) -> None:
    with pytest.raises(ParameterError) as err:
        parse_params(**values)
    message = str(err.value)
    assert "\n" not in message and message.startswith(flag), message


def test_defaults_keep_their_run_key_and_are_the_contract() -> None:
    assert UpscaleParams().encoding.is_default
    assert run_key("abc", UpscaleParams(), "m") == run_key("abc", UpscaleParams(codec="h264", audio="contract"), "m")
    assert run_key("abc", UpscaleParams(), "m") != run_key("abc", UpscaleParams(codec="ffv1"), "m")
    assert run_key("abc", UpscaleParams(), "m") != run_key("abc", UpscaleParams(audio="none"), "m")
    # The contract's settings; on an AVX-512 CPU x264 is also told its instruction sets
    # (tests/contract/test_encoding_*).
    assert {k: v for k, v in VideoEncoding().options().items() if k != "x264-params"} == {"crf": "18"}


def test_cli_refuses_a_bad_combination_before_any_work(clip_1f: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    store = tmp_path / "store"
    argv = ["upscale", str(clip_1f), "-o", str(out), "--store", str(store), "--codec", "ffv1", "--crf", "12"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "crf=12" in err and "ffv1" in err, err
    assert not out.exists() and not store.exists()


def test_plan_reports_the_output_format(tiny_bundle_path: Path, clip_1f: Path, tmp_path: Path, capsys) -> None:
    argv = ["plan", str(clip_1f), "--model", str(tiny_bundle_path), "--store", str(tmp_path), "--json"]
    assert main([*argv, "--codec", "hevc", "--crf", "22", "--preset", "fast", "--pix-fmt", "yuv420p10le"]) == 0
    shown = json.loads(capsys.readouterr().out)["output_format"]
    assert shown == {
        "codec": "hevc",
        "encoder": "libx265",
        "crf": 22,
        "preset": "fast",
        "pix_fmt": "yuv420p10le",
        "container": "mp4",
        "audio": "contract",
        "fps_mode": "contract",
        "frame_rate": "24",
        "variable_rate": False,
        "colour": "bt709/bt709/bt709/tv",
        "pixel_depth": 8,  # an 8-bit source: its frames are 8-bit whatever the output's pixel format
        "hdr_metadata": None,
    }


# ------------------------------------------------------------------------------------------------ codecs


@pytest.mark.parametrize(
    ("encoding", "container", "codec", "pix_fmt"),
    [
        (VideoEncoding(), "mp4", "h264", "yuv420p"),
        (VideoEncoding(pix_fmt="yuv444p", crf=12, preset="veryfast"), "mp4", "h264", "yuv444p"),
        (VideoEncoding(pix_fmt="yuv420p10le"), "mp4", "h264", "yuv420p10le"),
        (VideoEncoding(codec="hevc"), "mp4", "hevc", "yuv420p"),
        (VideoEncoding(codec="hevc", pix_fmt="yuv420p10le"), "mp4", "hevc", "yuv420p10le"),
        (VideoEncoding(codec="ffv1"), "matroska", "ffv1", "bgr0"),
        (VideoEncoding(codec="ffv1", pix_fmt="yuv444p"), "matroska", "ffv1", "yuv444p"),
    ],
)
def test_codecs_and_pixel_formats_are_written_as_asked(
    frames: np.ndarray, tmp_path: Path, encoding: VideoEncoding, container: str, codec: str, pix_fmt: str
) -> None:
    path = tmp_path / f"out{encoding.suffix}"
    media.write_video(path, frames, 24, np.zeros(44100, np.float32), 0, encoding)
    seen = _streams(path)
    assert container in str(seen["format"]) and seen["codec"] == codec and seen["pix_fmt"] == pix_fmt
    assert seen["frames"] == len(frames) and seen["audio"] == [("aac", 44100, 1, "und" if container == "mp4" else None)]


def test_default_encoding_writes_the_same_bytes_as_before(frames: np.ndarray, tmp_path: Path) -> None:
    media.write_video(tmp_path / "a.mp4", frames, 24, None)
    media.write_video(tmp_path / "b.mp4", frames, 24, None, 0, VideoEncoding(codec="h264", crf=18))
    assert (tmp_path / "a.mp4").read_bytes() == (tmp_path / "b.mp4").read_bytes()


def test_ffv1_segments_join_losslessly(frames: np.ndarray, tmp_path: Path) -> None:
    encoding = VideoEncoding(codec="ffv1")
    segments = []
    for index, part in enumerate((frames[:4], frames[4:7], frames[7:])):
        segments.append(str(tmp_path / f"{index}.mkv"))
        media.write_segment(segments[-1], part, 24, encoding)
    media.concat_segments(segments, tmp_path / "out.mkv", 24, np.zeros(20000, np.float32), len(frames), 0, encoding)
    assert np.array_equal(_decode(tmp_path / "out.mkv"), frames)


@pytest.mark.parametrize("lengths", [(1, 14), (14, 1), (1, 13, 2)])
def test_h264_segments_of_different_b_frame_delays_join_with_every_frame_on_time(
    lengths: tuple[int, ...], tmp_path: Path
) -> None:
    """A one-frame segment has no B-frame delay and a long one has two frames of it: joined as they come, the long
    one's first dts would step back and the muxer would rewrite the timing (the header said 5.000 s for 5.083 s)."""
    frames = np.random.default_rng(5).integers(0, 256, (sum(lengths), 32, 32, 3), dtype=np.uint8)
    segments, start = [], 0
    for index, length in enumerate(lengths):
        segments.append(str(tmp_path / f"{index}.mp4"))
        media.write_segment(segments[-1], frames[start : start + length], 24, VideoEncoding())
        start += length
    out = tmp_path / "out.mp4"
    media.concat_segments(segments, out, 24, None, len(frames), 0, VideoEncoding())
    media.check_output(out, media.planned_output(VideoEncoding(), len(frames), 24, (32, 32), 0))
    with av.open(str(out)) as container:
        video = container.streams.video[0]
        times = sorted(float(frame.pts * video.time_base) for frame in container.decode(video))
    assert times == pytest.approx([i / 24 for i in range(len(frames))])


def test_flow_and_runner_agree_on_ffv1_with_original_audio_and_it_holds_the_blended_frames_exactly(
    tiny_bundle: ModelBundle, tiny_bundle_path: Path, clip_1f: Path, tmp_path: Path
) -> None:
    from flows.orchestrate import run_clip
    from service.runs import ModelSpec, prepare_run

    params = UpscaleParams(scale=2, codec="ffv1", audio="original")  # clip_1f has stereo 48 kHz AAC
    reference = tmp_path / "ref.mkv"
    returned = upscale(clip_1f, reference, tiny_bundle, params, return_frames=True)
    assert returned.frames is not None and np.array_equal(_decode(reference), returned.frames)
    # The blend stage's frames, computed stage by stage.
    clip = read_source(clip_1f, params, model_traits(tiny_bundle.info))
    plan, window = clip.plan, clip.plan.windows[0]
    latent = stages.encode_clip(tiny_bundle, stages.prepare_window(read_window(clip, window), plan, window))
    chunks = [stages.denoise_chunk(tiny_bundle, stages.cut_tiles(latent, plan, c.tiles), c, plan) for c in plan.chunks]
    denoised = dict(zip([t for c in plan.chunks for t in c.tiles], [x for d in chunks for x in d], strict=True))
    tiles = [(i, stages.decode_tile(tiny_bundle, denoised[i])) for i in range(plan.num_tiles)]
    blended = stages.tensor_to_frames(stages.deliver(stages.blend(plan, tiles, window), plan))
    assert np.array_equal(_decode(reference), segment_frames(plan.windows, 0, blended, None))

    model = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    out = tmp_path / "flow.mkv"
    summary = run_clip(prepare_run(clip_1f, params, model, tmp_path / "store"), str(out), model).summary()
    assert out.read_bytes() == reference.read_bytes()
    assert summary.output_format["codec"] == "ffv1" and summary.output_format["container"] == "mkv"
    assert [a[:3] for a in _streams(out)["audio"]] == [("aac", 48000, 2)]


def test_python_api_returns_frames_and_audio_without_a_file(
    tiny_bundle: ModelBundle, clip_1f: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = upscale(clip_1f, None, tiny_bundle, UpscaleParams(scale=2), return_frames=True)
    assert result.output is None and list(tmp_path.iterdir()) == []
    assert result.frames is not None and result.frames.shape == (1, 192, 256, 3) and result.frames.dtype == np.uint8
    assert result.audio is not None and result.audio.shape == (round(44100 / 24),) and result.audio_rate == 44100
    with pytest.raises(ValueError, match="return_frames"):
        upscale(clip_1f, None, tiny_bundle, UpscaleParams(scale=2))


# ------------------------------------------------------------------------------------------------ audio


def test_original_audio_keeps_channels_rate_language_subtitles_and_title(
    subtitled_source: Path, tmp_path: Path
) -> None:
    part = np.random.default_rng(3).integers(0, 256, (8, 64, 64, 3), dtype=np.uint8)
    encoding = VideoEncoding(codec="ffv1")  # Matroska: takes the SubRip subtitles as they are
    segments = []
    for index in range(2):
        segments.append(str(tmp_path / f"{index}.mkv"))
        media.write_segment(segments[-1], part, 24, encoding)
    out = tmp_path / "out.mkv"
    media.concat_segments(segments, out, 24, None, 16, 0, encoding, str(subtitled_source))
    seen = _streams(out)
    assert seen["audio"] == [("aac", 48000, 2, "fra")]
    assert seen["subtitles"] == ["eng"] and seen["metadata"]["title"] == "My clip"
    with av.open(str(out)) as container:
        seconds = sum(frame.samples for frame in container.decode(audio=0)) / 48000
    # Copied packet by packet: trimmed to the output's 16 frames to within one AAC packet (and its priming).
    assert 16 / 24 <= seconds < 16 / 24 + 2 * 1024 / 48000


def _cues(path: Path) -> list[tuple[float, float, str]]:
    """(start s, end s, text) of every cue of the first subtitle stream, from the first video frame."""
    with av.open(str(path)) as container:
        stream = container.streams.subtitles[0]
        video = container.streams.video[0]
        origin = float((video.start_time or 0) * video.time_base)
        cues = []
        for packet in container.demux(stream):
            if not packet.size or packet.pts is None:
                continue
            for cue in stream.codec_context.decode(packet):
                start = float(packet.pts * packet.time_base) - origin
                text = cue.dialogue.decode() if hasattr(cue, "dialogue") else str(cue)
                if text:
                    cues.append((round(start, 3), round(start + float(packet.duration * packet.time_base), 3), text))
        return cues


def _joined(tmp_path: Path, encoding: VideoEncoding, source: Path, frames: int = 8) -> Path:
    part = np.random.default_rng(3).integers(0, 256, (frames, 64, 64, 3), dtype=np.uint8)
    segments = []
    for index in range(2):
        segments.append(str(tmp_path / f"{index}{encoding.suffix}"))
        media.write_segment(segments[-1], part, 24, encoding)
    out = tmp_path / f"out{encoding.suffix}"
    media.concat_segments(segments, out, 24, None, 2 * frames, 0, encoding, str(source))
    return out


def test_subrip_subtitles_become_mp4_timed_text_with_their_language_and_times(
    subtitled_source: Path, tmp_path: Path
) -> None:
    """MP4 holds only mov_text: the SubRip cues are converted, at their times, and the language tag goes along."""
    out = _joined(tmp_path, VideoEncoding(), subtitled_source, frames=12)  # 1 s: every cue whole
    with av.open(str(out)) as container:
        assert [s.codec_context.name for s in container.streams.subtitles] == ["mov_text"]
    assert _streams(out)["subtitles"] == ["eng"]
    assert _cues(out) == [(0.0, 0.4, "Hello"), (0.5, 0.9, "World")]


def test_mp4_timed_text_becomes_matroska_ass(subtitled_source: Path, tmp_path: Path) -> None:
    """The other way: an MP4 source's mov_text cues go into a Matroska output (FFV1) as ASS, at their times."""
    mp4 = _joined(tmp_path, VideoEncoding(), subtitled_source, frames=12)
    (tmp_path / "mkv").mkdir()
    out = _joined(tmp_path / "mkv", VideoEncoding(codec="ffv1"), mp4, frames=12)
    with av.open(str(out)) as container:
        assert [s.codec_context.name for s in container.streams.subtitles] in (["ass"], ["ssa"])  # FFmpeg's names
    assert _streams(out)["subtitles"] == ["eng"]
    assert [(start, text) for start, _, text in _cues(out)] == [(0.0, "Hello"), (0.5, "World")]


def test_subtitles_past_the_output_are_cut(subtitled_source: Path, tmp_path: Path) -> None:
    """Two 5-frame segments: 10 frames at 24 fps end at 0.417 s; the second cue starts after it, the first is cut."""
    out = _joined(tmp_path, VideoEncoding(), subtitled_source, frames=5)
    assert _cues(out) == [(0.0, 0.4, "Hello")]
    (tmp_path / "short").mkdir()
    out = _joined(tmp_path / "short", VideoEncoding(), subtitled_source, frames=4)
    assert _cues(out) == [(0.0, round(8 / 24, 3), "Hello")]


def test_runner_audio_modes(tiny_bundle: ModelBundle, tmp_path: Path) -> None:
    source = make_sample_clip(tmp_path / "stereo.mp4", width=64, height=64, num_frames=9, sample_rate=48000)
    assert _streams(source)["audio"][0][1:3] == (48000, 2)
    other = make_sample_clip(tmp_path / "other.mp4", width=64, height=64, num_frames=30, tone_hz=220)
    seen = {}
    for mode in ("original", "none", str(other)):
        out = tmp_path / f"{len(seen)}.mp4"
        upscale(source, out, tiny_bundle, UpscaleParams(scale=2, audio=mode))
        seen[mode] = _streams(out)["audio"]
    assert seen["original"] == [("aac", 48000, 2, "und")]
    assert seen["none"] == []
    assert seen[str(other)] == [("aac", 44100, 1, "und")]


# ------------------------------------------------------------------------------------------------ frame rate


def test_source_fps_keeps_every_frame_at_the_exact_rate(tiny_bundle: ModelBundle, tmp_path: Path) -> None:
    source = make_sample_clip(tmp_path / "ntsc.mp4", width=64, height=64, num_frames=10, fps=NTSC)
    assert media.probe(source).rate == "30000/1001"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = make_plan((64, 64), 10, 30000 / 1001, UpscaleParams(scale=2, fps_mode="source"), None, "30000/1001")
    assert plan.num_frames == 10 and plan.frame_rate == NTSC
    assert any("outside the trained contract" in str(w.message) for w in caught)
    assert make_plan((64, 64), 10, 30000 / 1001, UpscaleParams(scale=2)).num_frames == 8  # the contract's stride

    out = tmp_path / "out.mp4"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        upscale(source, out, tiny_bundle, UpscaleParams(scale=2, fps_mode="source"))
    with av.open(str(out)) as container:
        stream = container.streams.video[0]
        times = [frame.pts * stream.time_base for frame in container.decode(stream)]
        assert stream.average_rate == NTSC
    assert times == [i / NTSC for i in range(10)]


def _av_drift(path: Path, fps: Fraction, flashes: list[int]) -> float:
    """Largest distance (seconds) between a flash frame's time and the click heard with it."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        lit = [f.pts * stream.time_base for f in container.decode(stream) if f.to_ndarray(format="gray").mean() > 128]
    with av.open(str(path)) as container:
        clicks = []
        for frame in container.decode(audio=0):
            samples = frame.to_ndarray()[0]
            start = frame.pts * frame.time_base
            for position in np.flatnonzero(np.abs(samples) > 0.5):
                moment = start + Fraction(int(position), frame.sample_rate)
                if not clicks or moment - clicks[-1] > Fraction(1, 2):
                    clicks.append(moment)
    assert len(lit) == len(flashes) == len(clicks), (len(lit), len(flashes), len(clicks))
    return float(max(abs(a - b) for a, b in zip(lit, clicks, strict=True)))


@pytest.mark.parametrize("fps", [Fraction(24), NTSC], ids=["24", "30000/1001"])
def test_audio_and_video_stay_in_sync_over_ten_minutes(tmp_path: Path, fps: Fraction) -> None:
    """A flash every 10 s on the video and a click with it, joined from 121-frame segments as the flow does."""
    total = int(600 * fps)
    flashes = [int(round(second * fps)) for second in range(0, 600, 10)]
    rate = fps if fps.denominator != 1 else int(fps)
    segments, start = [], 0
    while start < total:
        count = min(121, total - start)
        part = np.zeros((count, 16, 16, 3), np.uint8)
        for flash in flashes:
            if start <= flash < start + count:
                part[flash - start] = 255
        segments.append(str(tmp_path / f"{len(segments):04d}.mp4"))
        media.write_segment(segments[-1], part, rate)
        start += count
    audio = np.zeros(round(total / fps * media.AUDIO_SAMPLE_RATE), np.float32)
    for flash in flashes:
        at = round(flash / fps * media.AUDIO_SAMPLE_RATE)
        audio[at : at + 64] = 0.9
    out = tmp_path / "out.mp4"
    media.concat_segments(segments, out, rate, audio, total)
    drift = _av_drift(out, fps, flashes)
    print(f"A/V drift over 10 minutes at {fps} fps: {drift * 1000:.2f} ms (one frame: {1000 / float(fps):.2f} ms)")
    assert drift < 1 / fps, f"A/V drift {drift * 1000:.1f} ms over 10 minutes"


# ------------------------------------------------------------------------------------------------ latent input


@pytest.fixture(scope="module")
def latent_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1 frame of 128x128: one tile of the tiny bundle, on its grid."""
    return make_sample_clip(tmp_path_factory.mktemp("latent") / "c.mp4", width=128, height=128, num_frames=1)


@pytest.mark.parametrize("scale", [2, 4])
def test_latent_from_our_encode_stage_gives_the_output_of_its_video(
    tiny_bundle: ModelBundle, latent_source: Path, tmp_path: Path, scale: int
) -> None:
    from safetensors.torch import load_file, save_file

    params = UpscaleParams(scale=scale, audio="none")
    reference = upscale(latent_source, None, tiny_bundle, params, return_frames=True)
    clip = read_source(latent_source, params, model_traits(tiny_bundle.info))
    window = clip.plan.windows[0]
    latent = stages.encode_latent(tiny_bundle, stages.prepare_window(read_window(clip, window), clip.plan, window))
    assert tuple(latent.shape) == (1, 64, 8, 8)  # [T, C, H, W], unscaled
    save_file({"sr_lr_latent": latent}, str(tmp_path / "latent.safetensors"))
    loaded = load_file(str(tmp_path / "latent.safetensors"))["sr_lr_latent"]
    out = tmp_path / "out.mp4"
    result = upscale(None, out, tiny_bundle, params, return_frames=True, latent=loaded, fps=24)
    assert result.frames is not None and np.array_equal(result.frames, reference.frames)
    assert _streams(out)["audio"] == [] and _streams(out)["frames"] == 1


@pytest.mark.parametrize(
    ("latent", "values", "fps", "words"),
    [
        (np.zeros((3, 64, 8, 8), np.float32), {"scale": 2.25}, 24, "pre-upscale"),
        (np.zeros((64, 8, 8), np.float32), {"scale": 2}, 24, "[T, C, H, W]"),
        (np.zeros((3, 16, 8, 8), np.float32), {"scale": 2}, 24, "16 channels"),
        (np.zeros((3, 64, 8, 8), np.int32), {"scale": 2}, 24, "dtype"),
        (np.zeros((4, 64, 8, 8), np.float32), {"scale": 4}, 24, "odd count"),
        (np.zeros((3, 64, 8, 8), np.float32), {"scale": 4}, "fast", "fps"),
    ],
)
def test_bad_latents_are_refused_before_any_work(
    tiny_bundle: ModelBundle, tmp_path: Path, latent: np.ndarray, values: dict, fps: object, words: str
) -> None:
    out = tmp_path / "out.mp4"
    with pytest.raises(ParameterError) as err:
        upscale(None, out, tiny_bundle, UpscaleParams(**values), latent=torch.from_numpy(latent), fps=fps)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_audio_file_without_audio_is_refused_before_any_work(
    tiny_bundle: ModelBundle, clip_1f: Path, tmp_path: Path
) -> None:
    silent = make_sample_clip(tmp_path / "silent.mp4", width=64, height=64, num_frames=1, audio=False)
    out = tmp_path / "out" / "o.mp4"
    out.parent.mkdir()
    with pytest.raises(MediaError, match="no audio stream"):
        upscale(clip_1f, out, tiny_bundle, UpscaleParams(scale=2, audio=str(silent)))
    assert list(out.parent.iterdir()) == []


def test_hevc_refuses_frames_too_small_for_x265(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 128"):
        media.write_video(
            tmp_path / "x.mp4", np.zeros((2, 64, 64, 3), np.uint8), 24, None, 0, VideoEncoding(codec="hevc")
        )
    assert not (tmp_path / "x.mp4").exists()


@pytest.mark.parametrize("pix_fmt", ["yuv420p", "yuv420p10le"])
def test_a_one_frame_hevc_file_is_written_every_time(pix_fmt: str, tmp_path: Path) -> None:
    """x265 leaves a one-frame stream's decode time uninitialised (3 of 4 writes failed in the MP4 muxer before the
    writer mended it): a one-frame shot's segment must not fail at random."""
    dtype = np.uint16 if pix_fmt.endswith("10le") else np.uint8
    frames = np.full((1, 128, 128, 3), np.iinfo(dtype).max // 2, dtype)
    for attempt in range(8):
        out = tmp_path / f"{attempt}.mp4"
        media.write_video(out, frames, 24, None, encoding=VideoEncoding(codec="hevc", pix_fmt=pix_fmt))
        assert media.probe(out).num_frames == 1


# ------------------------------------------------------------------------------------------------ health check


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, media.PlannedOutput]:
    """9 frames of 64x48 at 24 fps with half a second of audio, and the plan they were written to."""
    path = tmp_path_factory.mktemp("checked") / "out.mp4"
    frames = np.random.default_rng(3).integers(0, 256, (9, 48, 64, 3), dtype=np.uint8)
    media.write_video(path, frames, 24, np.zeros(22050, np.float32))
    return path, media.planned_output(VideoEncoding(), 9, 24, (48, 64), 22050)


def test_the_health_check_passes_what_was_written_as_planned(written: tuple[Path, media.PlannedOutput]) -> None:
    path, planned = written
    assert planned.streams == ("audio:aac",) and planned.colour == media.ColourTags.of_codes(1, 1, 1, 1)
    media.check_output(path, planned)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"frames": 10}, "9 frame(s) decode, 10 planned; duration 0.375 s (frames span), 0.417 s planned"),
        ({"frame_rate": "30"}, "duration 0.375 s (frames span), 0.300 s planned; duration 0.375 s (header says)"),
        ({"width": 66}, "size 64x48, 66x48 planned"),
        ({"codec": "hevc"}, "codec h264, hevc planned"),
        ({"pix_fmt": "yuv444p"}, "pixel format yuv420p, yuv444p planned"),
        ({"colour": media.ColourTags.of_codes(9, 16, 9, 1)}, "colour tags bt709/bt709/bt709/tv, bt2020/smpte2084"),
        ({"streams": ()}, "other streams audio:aac, none planned"),
        (
            {"hdr": HdrMetadata(light=ContentLight(max_cll=1000, max_fall=400))},
            "HDR metadata none, content light MaxCLL 1000, MaxFALL 400 cd/m² planned",
        ),
    ],
)
def test_the_health_check_names_what_differs_from_the_plan(
    written: tuple[Path, media.PlannedOutput], change: dict, words: str
) -> None:
    path, planned = written
    with pytest.raises(media.OutputMismatch) as err:
        media.check_output(path, planned.model_copy(update=change))
    assert words in str(err.value) and "not published" in str(err.value), str(err.value)
    assert len(err.value.problems) == (3 if "frames" in change else 2 if "frame_rate" in change else 1)
    assert path.exists()


def test_an_output_that_does_not_decode_fails_the_health_check(tmp_path: Path) -> None:
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"\x00" * 2048)
    with pytest.raises(media.OutputMismatch, match="does not decode"):
        media.check_output(junk, media.planned_output(VideoEncoding(), 1, 24, (48, 64)))


def test_a_mistagged_output_fails_the_run_and_publishes_nothing(
    tiny_bundle: ModelBundle, tiny_bundle_path: Path, clip_1f: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """The injected fault: the writer tags BT.601 (smpte170m) where the plan says BT.709."""
    from k6vsr_core.media import writing

    for table in ("PRIMARY_CODES", "TRANSFER_CODES", "MATRIX_CODES"):
        monkeypatch.setattr(writing, table, {**getattr(writing, table), "bt709": 6})
    out = tmp_path / "runner" / "o.mp4"
    out.parent.mkdir()
    with pytest.raises(media.OutputMismatch, match="colour tags smpte170m/smpte170m/smpte170m/tv, bt709/bt709"):
        upscale(clip_1f, out, tiny_bundle, UpscaleParams(scale=2))
    assert list(out.parent.iterdir()) == []

    store, folder = tmp_path / "store", tmp_path / "cli"
    argv = ["upscale", str(clip_1f), "-o", str(folder), "--model", str(tiny_bundle_path), "--store", str(store)]
    assert main([*argv, "--device", "cpu", "--scale", "2"]) == 1
    assert "colour tags smpte170m/smpte170m/smpte170m/tv, bt709/bt709/bt709/tv planned" in capsys.readouterr().err
    assert not folder.exists() or list(folder.iterdir()) == []
    assert list(store.rglob("output*")) == []
