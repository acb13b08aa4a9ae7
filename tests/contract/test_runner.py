"""End-to-end tests of the in-memory runner `upscale` on the tiny bundle and tiny synthetic clips."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from k6vsr_core import media
from k6vsr_core.contract.params import parse_params
from k6vsr_core.media.sample import make_sample_clip
from k6vsr_core.model.bundle import ModelBundle
from k6vsr_core.model.runner import UpscaleResult, upscale


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runner")


@pytest.fixture(scope="module")
def silent_clip(clip_dir: Path) -> Path:
    """One 96x64 (WxH) frame at 24 fps, no audio stream."""
    return make_sample_clip(clip_dir / "silent.mp4", width=96, height=64, num_frames=1, audio=False)


@pytest.fixture(scope="module")
def x2_result(silent_clip: Path, clip_dir: Path, tiny_bundle: ModelBundle) -> UpscaleResult:
    return upscale(silent_clip, clip_dir / "x2.mp4", tiny_bundle, parse_params(scale=2))


def _frames(path: str | Path) -> np.ndarray:
    """Every frame of a video, as RGB."""
    count, pts = media.scan_frames(path)
    return media.read_frames(path, list(range(count)), pts)


def test_x2_output_size(x2_result: UpscaleResult) -> None:
    info = media.probe(x2_result.output)
    assert (info.width, info.height) == (192, 128)
    assert info.num_frames == 1
    assert info.fps == 24
    # 2 tiles (lefts 0 and 32 of a 64x64 LR tile), 2 PiFlow evaluations each.
    assert x2_result.plan.num_tiles == 2
    assert x2_result.dit_calls == 4
    assert set(x2_result.timings) == {"ingest", "encode", "denoise", "decode", "blend", "segment", "mux"}


def test_silent_source_gives_video_only_output(x2_result: UpscaleResult) -> None:
    assert media.probe(x2_result.output).has_audio is False
    assert media.decode_audio(x2_result.output) is None


def test_same_call_twice_is_byte_identical(
    x2_result: UpscaleResult, silent_clip: Path, clip_dir: Path, tiny_bundle: ModelBundle
) -> None:
    again = upscale(silent_clip, clip_dir / "x2-again.mp4", tiny_bundle, parse_params(scale=2))
    assert Path(again.output).read_bytes() == Path(x2_result.output).read_bytes()


def test_x4_output_size(silent_clip: Path, clip_dir: Path, tiny_bundle: ModelBundle) -> None:
    result = upscale(silent_clip, clip_dir / "x4.mp4", tiny_bundle, parse_params(scale=4))
    info = media.probe(result.output)
    assert (info.width, info.height) == (384, 256)
    # x4 LR tile 32x32 on 64x96: tops (0, 16, 32), lefts (0, 16, 32, 48, 64).
    assert result.plan.num_tiles == 15


def test_x225_output_size(silent_clip: Path, clip_dir: Path, tiny_bundle: ModelBundle) -> None:
    result = upscale(silent_clip, clip_dir / "x225.mp4", tiny_bundle, parse_params())
    info = media.probe(result.output)
    # 64x96 (HxW) pre-upscales to (round(4.5)*16, round(6.75)*16) = (64, 112), then x2.
    assert (info.width, info.height) == (224, 128)


def test_batch_size_changes_the_output(
    x2_result: UpscaleResult, silent_clip: Path, clip_dir: Path, tiny_bundle: ModelBundle
) -> None:
    result = upscale(silent_clip, clip_dir / "x2-b2.mp4", tiny_bundle, parse_params(scale=2, tiles_batch_size=2))
    assert [c.seed for c in result.plan.chunks] == [42]
    assert [c.seed for c in x2_result.plan.chunks] == [42, 43]
    assert result.dit_calls == 2
    ours, batched = _frames(x2_result.output), _frames(result.output)
    assert ours.shape == batched.shape == (1, 128, 192, 3)
    # Tile 1 gets slice 1 of seed 42's draw instead of seed 43's: its part of the frame changes.
    assert not np.array_equal(ours, batched)
    assert np.abs(ours[:, :, 128:].astype(int) - batched[:, :, 128:].astype(int)).mean() > 1.0


def test_target_resolution_smaller_than_result(silent_clip: Path, clip_dir: Path, tiny_bundle: ModelBundle) -> None:
    result = upscale(
        silent_clip, clip_dir / "x2-small.mp4", tiny_bundle, parse_params(scale=2, target_resolution="96x64")
    )
    info = media.probe(result.output)
    assert (info.width, info.height) == (96, 64)
    assert result.plan.sr_size == (128, 192)
    assert result.plan.delivery_size == (64, 96)


def test_30fps_clip_with_audio(clip_dir: Path, tiny_bundle: ModelBundle) -> None:
    source = make_sample_clip(clip_dir / "fps30.mp4", width=64, height=64, num_frames=12, fps=30, audio=True)
    result = upscale(source, clip_dir / "fps30-x2.mp4", tiny_bundle, parse_params(scale=2))
    # Stride 30/24 = 1.25 over int(12/1.25) = 9 outputs: round(i*1.25) = 0, 1, 2, 4, 5, 6, 8, 9, 10 (half to
    # even: 2.5 -> 2, 7.5 -> 8); 9 = 1 + 8*1 frames are kept, played at 24 fps.
    assert result.plan.num_frames == 9
    assert result.plan.fps == 24
    assert result.plan.latent_frames == 3
    info = media.probe(result.output)
    assert (info.width, info.height) == (128, 128)
    assert info.num_frames == 9
    assert info.fps == 24
    assert info.has_audio is True
    assert len(_frames(result.output)) == 9
    audio = media.decode_audio(result.output)
    assert audio is not None
    # The 0.4 s source tone is cut to 9 frames / 24 fps = 0.375 s: round(0.375 * 44100) = 16538 samples.
    assert abs(len(audio) - 16538) <= 1024
    assert float(np.abs(audio).max()) > 0.1


def test_a_window_is_blended_and_written_while_the_next_is_decoded(
    tiny_bundle: ModelBundle, clip_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two windows through the runner with the model's stages replaced by blank ones (a decode takes 0.3 s) that
    record when they ran, as does the segment writer (made 0.5 s slower): window 0's segment is written while window
    1's tiles decode, on a thread of its own."""
    import threading
    import time

    import torch

    from k6vsr_core.model import runner, stages

    events: list[tuple[str, int, float, float, str]] = []
    window = {"index": -1, "frames": 0}
    plain_write = runner.segments.write_segment

    def encode_clip(bundle: ModelBundle, video: torch.Tensor) -> torch.Tensor:
        window["index"] += 1
        window["frames"] = video.shape[0]
        return torch.zeros(1)

    def decode_tile(bundle: ModelBundle, latent: object, depth: int = 8) -> torch.Tensor:
        started = time.monotonic()
        time.sleep(0.3)
        tile = torch.zeros((3, window["frames"], *grid_base), dtype=torch.uint8)
        events.append(("decode", window["index"], started, time.monotonic(), threading.current_thread().name))
        return tile

    def write_segment(path: str, *args: object) -> None:
        started = time.monotonic()
        plain_write(path, *args)
        time.sleep(0.5)  # an encoder that takes its time, as x264 on full-size frames does
        events.append(("segment", int(Path(path).stem), started, time.monotonic(), threading.current_thread().name))

    source = make_sample_clip(clip_dir / "two-windows.mp4", width=64, height=64, num_frames=130, audio=False)
    params = parse_params(scale=2)
    grid_base = runner.read_source(source, params, runner.model_traits(tiny_bundle.info)).plan.grid.base
    monkeypatch.setattr(stages, "encode_clip", encode_clip)
    monkeypatch.setattr(stages, "cut_tiles", lambda encoded, plan, tiles: [None] * len(tiles))
    monkeypatch.setattr(stages, "denoise_chunk", lambda bundle, lr, chunk, plan, count: [None] * len(chunk.tiles))
    monkeypatch.setattr(stages, "decode_tile", decode_tile)
    monkeypatch.setattr(runner.segments, "write_segment", write_segment)
    result = upscale(source, clip_dir / "two-windows-x2.mp4", tiny_bundle, params)

    assert result.plan.num_windows == 2 and media.probe(result.output).num_frames == 130
    segment_0 = next(e for e in events if e[:2] == ("segment", 0))
    first_decode_1 = min(e[2] for e in events if e[:2] == ("decode", 1))
    assert segment_0[3] > first_decode_1, events  # window 0 was still being written when window 1's decode began
    assert segment_0[4] != next(e[4] for e in events if e[0] == "decode")
    assert set(result.timings) == {"ingest", "encode", "denoise", "decode", "blend", "segment", "mux"}
