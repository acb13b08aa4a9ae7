"""The same frames encode to the same bytes in every process, whatever the process did before.

x264's AVX-512 code reads memory it never wrote, so on such a CPU its output followed the state of the heap: a
resumed run (a fresh process) could write other bytes than the run it resumed. `k6vsr_core.media.encoding` keeps x264 to
the CPU's instruction sets below AVX-512 there.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import av
import numpy as np

from k6vsr_core import media
from k6vsr_core.media.encoding import VideoEncoding, x264_instructions
from k6vsr_core.media.sample import make_sample_clip, sample_frames

_AVX512_CPU = (
    "processor\t: 0\nflags\t\t: fpu sse sse2 pni ssse3 sse4_1 sse4_2 avx fma avx2 bmi1 bmi2 abm avx512f avx512bw\n"
)


def test_x264_gets_every_instruction_set_but_avx512(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(_AVX512_CPU)
    names = x264_instructions.__wrapped__(cpuinfo).split(",")
    assert "AVX2" in names and "FMA3" in names and "SSE4.2" in names
    assert not [name for name in names if "512" in name]


def test_x264_detects_for_itself_without_avx512(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(_AVX512_CPU.replace(" avx512f avx512bw", ""))
    assert x264_instructions.__wrapped__(cpuinfo) is None
    assert x264_instructions.__wrapped__(tmp_path / "missing") is None


def test_the_contract_options_name_the_instruction_sets_only_where_needed() -> None:
    options = VideoEncoding().options()
    assert options["crf"] == "18"
    assert options.get("x264-params") == (f"asm={x264_instructions()}" if x264_instructions() else None)


def _dirty_the_heap(clip: Path) -> None:
    """What a run does between two encodes: decode video, allocate and free."""
    with av.open(str(clip)) as container:
        _ = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    _ = [np.random.default_rng(seed).integers(0, 255, 1 << 16, dtype=np.uint8) for seed in range(64)]


def test_the_same_frames_give_the_same_bytes_every_time(tmp_path: Path) -> None:
    """130x130 (not a multiple of 16) differed on nearly every encode before; 64x64 on about one in six."""
    clip = make_sample_clip(tmp_path / "noise.mp4", width=96, height=96, num_frames=24)
    for size, count in ((130, 30), (64, 60)):
        frames = sample_frames(size, size, count)
        digests = set()
        for attempt in range(6):
            out = tmp_path / f"{size}-{attempt}.mp4"
            media.write_segment(out, frames, 24)
            digests.add(hashlib.sha256(out.read_bytes()).hexdigest())
            _dirty_the_heap(clip)
        assert len(digests) == 1, f"{size}x{size}: {len(digests)} different encodings of the same frames"


def test_the_sample_clip_is_the_same_file_every_time(tmp_path: Path) -> None:
    digests = set()
    for attempt in range(6):
        path = make_sample_clip(tmp_path / f"{attempt}.mp4", width=64, height=64, num_frames=120, fps=25)
        digests.add(hashlib.sha256(path.read_bytes()).hexdigest())
        _dirty_the_heap(path)
    assert len(digests) == 1
