"""Synthetic sources the media tests share, made with PyAV: each test file draws its clips from here rather than
keeping its own copy of a maker."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from k6vsr_core import media
from k6vsr_core.media.checking import ColourTags

MS = Fraction(1, 1000)
MASTER_DISPLAY = "G(8500,39850)B(6550,2300)R(35400,14600)WP(15635,16450)L(10000000,50)"
PATCH = (200, 40, 60)
SECOND_PATCH = (30, 90, 210)


FONT = b"\x00\x01\x00\x00" + bytes(range(256)) * 4  # stands in for a TrueType font an ASS subtitle needs


def phone_times_ms(count: int, durations_ms: Sequence[int] = (33, 50, 25, 42)) -> list[int]:
    """A phone's frame times: `count` frames at steps cycling through `durations_ms`, never regular."""
    times = [0]
    for index in range(count - 1):
        times.append(times[-1] + durations_ms[index % len(durations_ms)])
    return times


def write_vfr(
    path: Path,
    frames: np.ndarray,
    times_ms: Sequence[int],
    audio_s: float | None = None,
    rotation: int = 0,
    tone_hz: float = 0.0,
) -> Path:
    """H.264 (lossless) in MP4 with each frame at its millisecond time, as a phone writes; `audio_s` seconds of 48 kHz
    stereo (silence, or a `tone_hz` sine) from 0; `rotation` as the display matrix."""
    tick = MS
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "0"}
        stream.codec_context.time_base = stream.time_base = tick
        if rotation:
            stream.set_display_rotation(rotation)
        sound = container.add_stream("aac", rate=48000, layout="stereo") if audio_s else None
        for rgb, at in zip(frames, times_ms, strict=True):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), "rgb24")
            frame.pts, frame.time_base = at, tick
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
        if sound is not None:
            t = np.arange(round(48000 * audio_s)) / 48000
            wave = (0.5 * np.sin(2 * np.pi * tone_hz * t)).astype(np.float32)
            samples = av.AudioFrame.from_ndarray(np.stack([wave, wave]), format="fltp", layout="stereo")
            samples.sample_rate, samples.pts, samples.time_base = 48000, 0, Fraction(1, 48000)
            container.mux(sound.encode(samples))
            container.mux(sound.encode(None))
    return path


# ------------------------------------------------------------------------------------------------ colour


def colour_source(
    path: Path,
    tags: ColourTags,
    *,
    codec: str = "libx264",
    pix_fmt: str = "yuv420p",
    size: int = 64,
    frames: int = 1,
    x265_params: str = "",
    cut_at: int | None = None,
) -> Path:
    """A flat `PATCH` clip, its YUV made with the tags' own matrix and range, and tagged with them; from frame
    `cut_at` on, if given, a flat `SECOND_PATCH` (a hard cut between two shots)."""
    from k6vsr_core.media.colour import MATRIX_CODES, PRIMARY_CODES, TRANSFER_CODES

    options = (
        {"crf": "0"}
        if codec == "libx264"
        else {"x265-params": f"log-level=error:frame-threads=1:pools=none:bframes=0{x265_params}"}
    )
    first = np.zeros((size, size, 3), np.uint16 if "10" in pix_fmt else np.uint8)
    second = first.copy()
    for image, patch in ((first, PATCH), (second, SECOND_PATCH)):
        image[:] = [value << 8 for value in patch] if image.dtype == np.uint16 else patch
    with av.open(str(path), "w") as out:
        video = out.add_stream(codec, rate=24, options=options)
        video.width = video.height = size
        video.pix_fmt = pix_fmt
        context = video.codec_context
        context.color_primaries = PRIMARY_CODES[tags.primaries]
        context.color_trc = TRANSFER_CODES[tags.transfer]
        context.colorspace = MATRIX_CODES[tags.matrix]
        context.color_range = {"tv": 1, "pc": 2}[tags.range]
        for index in range(frames):
            rgb = second if cut_at is not None and index >= cut_at else first
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb48le" if rgb.dtype == np.uint16 else "rgb24")
            frame = frame.reformat(
                format=pix_fmt, dst_colorspace=context.colorspace, dst_color_range=context.color_range
            )
            frame.pts = index
            mux_in_order(out, video.encode(frame))
        mux_in_order(out, video.encode(None))
    return path


def mux_in_order(out: av.container.OutputContainer, packets: list[av.Packet]) -> None:
    for packet in packets:
        # Without B-frames decode order is display order; x265 (as in PyAV's wheels) sometimes leaves a 128-px
        # one-frame stream's dts uninitialised, which the MP4 muxer then refuses.
        packet.dts = packet.pts
        out.mux(packet)


def hdr_source(path: Path, transfer: str, frames: int = 1, cut_at: int | None = None) -> Path:
    """HEVC main10 BT.2020 with `transfer` (smpte2084: HDR10, arib-std-b67: HLG) and HDR10 metadata, `frames` long
    (with a cut at `cut_at`, see `colour_source`)."""
    return colour_source(
        path,
        ColourTags(primaries="bt2020", transfer=transfer, matrix="bt2020nc", range="tv"),
        codec="libx265",
        pix_fmt="yuv420p10le",
        size=media.HEVC_MIN_SIDE,
        x265_params=f":hdr10=1:master-display={MASTER_DISPLAY}:max-cll=1000,400",
        frames=frames,
        cut_at=cut_at,
    )


# ------------------------------------------------------------------------------------------------ fields


def interlaced_frames(frame_count: int, top_first: bool, size: int = 64) -> np.ndarray:
    """(T, H, W, 3) frames of bars that move between fields: each field holds the picture at its own instant (the
    first shown half a frame before the second), as an interlaced camera takes it."""
    frames = np.zeros((frame_count, size, size, 3), np.uint8)
    frames[:] = 40
    for index in range(frame_count):
        for line_parity in (0, 1):
            shown_second = line_parity if top_first else 1 - line_parity
            instant = 2 * index + shown_second
            left = (5 * instant) % (size - 16)
            frames[index, line_parity::2, left : left + 16] = 230
    return frames


def write_interlaced(path: Path, frames: np.ndarray, order: str | None, rate: int = 25) -> Path:
    """H.264 in MP4: coded interlaced with `order` ('tff' or 'bff') declared, or progressive-coded with no flag."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        options = {"crf": "8"}
        flags = None
        if order is not None:
            stream.codec_context.flags |= av.codec.context.Flags.interlaced_dct | av.codec.context.Flags.interlaced_me
            options["x264-params"] = f"{order}=1"
            # setfield marks each frame interlaced with its field order, which x264 codes and signals.
            flags = av.filter.Graph()
            source = flags.add_buffer(
                width=frames.shape[2], height=frames.shape[1], format="yuv420p", time_base=Fraction(1, rate)
            )
            node, sink = flags.add("setfield", order), flags.add("buffersink")
            source.link_to(node)
            node.link_to(sink)
            flags.configure()
        stream.options = options
        for index, image in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(image, format="rgb24").reformat(format="yuv420p")
            frame.pts, frame.time_base = index, Fraction(1, rate)
            if flags is not None:
                flags.vpush(frame)
                frame = flags.vpull()
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


# ------------------------------------------------------------------------------------ pictures, geometry, streams


def smooth_frames(frames: int, height: int, width: int) -> np.ndarray:
    """Gradients moving a pixel a frame: lossy codecs keep them within a few levels, as they keep the model's
    output; noise would measure only the codec's rate control."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    out = [
        np.stack([x * 200 / width + t, y * 200 / height + 20, (x + y) * 100 / (width + height) + 60 + t], -1)
        for t in range(frames)
    ]
    return np.clip(np.stack(out), 0, 255).astype(np.uint8)


def anamorphic_source(path: Path, width: int, height: int, sar: Fraction, frames: int = 1) -> Path:
    """A clip whose pixels are not square: the SAR in the H.264 stream and in the container, as a DV or DVD
    transfer has it. The picture has a black border (letterbox bars), which must come back uncropped."""
    image = smooth_frames(frames, height, width)
    image[:, : height // 8] = 0
    image[:, height - height // 8 :] = 0
    with av.open(str(path), "w") as out:
        video = out.add_stream("libx264", rate=25)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        video.codec_context.sample_aspect_ratio = sar
        for index, picture in enumerate(image):
            frame = av.VideoFrame.from_ndarray(picture, format="rgb24")
            frame.pts, frame.time_base = index, Fraction(1, 25)
            out.mux(video.encode(frame))
        out.mux(video.encode(None))
    return path


def broadcast_source_file(path: Path) -> Path:
    """0.3 s of 29.97 fps 64x48 in Matroska: English stereo and French mono audio, four chapters (the last starts
    after the end, the third runs past it) and a font attachment."""
    with av.open(str(path), "w", format="matroska") as out:
        out.metadata["title"] = "Episode 1"
        video = out.add_stream("libx264", rate=Fraction(30000, 1001))
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        sounds = []
        for language, layout in (("eng", "stereo"), ("fra", "mono")):
            sound = out.add_stream("aac", rate=48000, layout=layout)
            sound.metadata["language"] = language
            sounds.append((sound, layout))
        spans = [(0, 100), (100, 200), (200, 2000), (1000, 2000)]
        out.set_chapters(
            [
                {
                    "id": i + 1,
                    "start": a,
                    "end": b,
                    "time_base": Fraction(1, 1000),
                    "metadata": {"title": f"Part {i + 1}"},
                }
                for i, (a, b) in enumerate(spans)
            ]
        )
        out.add_attachment("font.ttf", "application/x-truetype-font", FONT)
        for index, picture in enumerate(smooth_frames(9, 48, 64)):
            frame = av.VideoFrame.from_ndarray(picture, format="rgb24")
            frame.pts, frame.time_base = index, Fraction(1001, 30000)
            out.mux(video.encode(frame))
        out.mux(video.encode(None))
        for sound, layout in sounds:
            channels = 2 if layout == "stereo" else 1
            samples = av.AudioFrame.from_ndarray(np.zeros((channels, 14400), np.float32), format="fltp", layout=layout)
            samples.sample_rate, samples.pts, samples.time_base = 48000, 0, Fraction(1, 48000)
            out.mux(sound.encode(samples))
            out.mux(sound.encode(None))
    return path


def prores_master(folder: Path) -> Path:
    """A post-production master: one frame of 10-bit 4:2:2 ProRes 422 HQ, 64x48, with 24-bit stereo PCM and an
    English SubRip subtitle, in Matroska (which holds all three as they are)."""
    srt = folder / "subs.srt"
    srt.write_text("1\n00:00:00,000 --> 00:00:00,030\nSlate\n\n")
    path = folder / "master.mkv"
    with av.open(str(srt)) as subs, av.open(str(path), "w", format="matroska") as out:
        video = out.add_stream("prores_ks", rate=24, options={"profile": "hq"})
        video.width, video.height, video.pix_fmt = 64, 48, "yuv422p10le"
        sound = out.add_stream("pcm_s24le", rate=48000, layout="stereo")
        text = out.add_stream_from_template(subs.streams[0])
        text.metadata["language"] = "eng"
        frame = av.VideoFrame.from_ndarray(smooth_frames(1, 48, 64)[0], format="rgb24").reformat(format="yuv422p10le")
        frame.pts, frame.time_base = 0, Fraction(1, 24)
        out.mux(video.encode(frame))
        out.mux(video.encode(None))
        samples = av.AudioFrame.from_ndarray(np.zeros((1, 4000), np.int32), format="s32", layout="stereo")
        samples.sample_rate, samples.pts, samples.time_base = 48000, 0, Fraction(1, 48000)
        out.mux(sound.encode(samples))
        out.mux(sound.encode(None))
        for packet in subs.demux(subs.streams[0]):
            if packet.size:
                packet.stream = text
                out.mux(packet)
    return path


# Shots for the scene tests: each a smooth pattern of its own colours.
HUES = ((200, 60, 30), (30, 120, 220), (40, 200, 60), (220, 200, 40))


def shot_frames(shot: int, count: int, size: tuple[int, int] = (64, 64), start: int = 0) -> np.ndarray:
    """`count` frames of a shot: a smooth pattern of the shot's own colours, panning a little every frame."""
    y, x = np.mgrid[0 : size[0], 0 : size[1]]
    frames = []
    for i in range(start, start + count):
        wave = np.sin((x + 2 * i) / 9.0 + shot) * 0.35 + np.cos((y - i) / 13.0 + 2 * shot) * 0.15 + 0.5
        frames.append((wave[..., None] * np.array(HUES[shot % len(HUES)])).astype(np.uint8))
    return np.stack(frames)


def clip_frames(lengths: list[int]) -> tuple[np.ndarray, tuple[int, ...]]:
    """Shots of `lengths` frames one after the other, and the known cuts between them."""
    frames = np.concatenate([shot_frames(shot, count) for shot, count in enumerate(lengths)])
    return frames, tuple(int(cut) for cut in np.cumsum(lengths)[:-1])
