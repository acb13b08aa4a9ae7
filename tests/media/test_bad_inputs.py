"""Bad inputs through the real command: every one runs correctly or is refused clearly, before any model work.

The corpus is generated here (no media is committed). A refusal must exit with code 2, print one `k6vsr: error:`
line that names the file (or the parameter) and the cause, print no traceback, load no model, start no run in the
store and leave nothing in the output folder. An input the contract covers must run, and its output must be the
in-memory runner's, byte for byte.

Inputs PyAV cannot write are covered at the probe level with a stand-in stream, and say so: a zero, negative or
missing frame rate (FFmpeg invents 25 fps for a stream without timing, which the raw H.264 case shows). Conditions
root cannot meet for real are emulated: an unreadable file (root reads anything), and a read-only or full output
folder when this machine does not let the test mount a small tmpfs (where it does, the real ones run too).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import fault_harness
import numpy as np
import pytest

from entrypoints.cli import main
from k6vsr_core import media, upscale
from k6vsr_core.contract.params import UpscaleParams, parse_params
from k6vsr_core.contract.plan import ModelTraits
from k6vsr_core.contract.source import read_source
from k6vsr_core.errors import MediaError
from k6vsr_core.media import probing
from k6vsr_core.media.sample import make_sample_clip

pytestmark = pytest.mark.usefixtures("prefect_server")

SCALE2 = ("--scale", "2")


# ------------------------------------------------------------------------------------------------ the corpus


def _encode(
    path: Path,
    *,
    codec: str = "libx264",
    pix_fmt: str = "yuv420p",
    width: int = 64,
    height: int = 64,
    frames: int = 1,
    rate: int | Fraction = 24,
    pts_ms: list[int] | None = None,
    rotation: int | None = None,
    fmt: str | None = None,
    options: dict[str, str] | None = None,
    container_options: dict[str, str] | None = None,
) -> Path:
    rgb = make_frames(width, height, frames)
    with av.open(str(path), "w", format=fmt, options=container_options or {}) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        if options:
            stream.options = options
        if pts_ms is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        if rotation is not None:
            stream.set_display_rotation(rotation)
        for index, image in enumerate(rgb):
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            if pts_ms is not None:
                frame.pts, frame.time_base = pts_ms[index], Fraction(1, 1000)
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def make_frames(width: int, height: int, frames: int) -> np.ndarray:
    """Textured frames (a gradient and noise), so every codec really has to code something."""
    rng = np.random.default_rng(width * 1000 + height)
    ys, xs = np.mgrid[0:height, 0:width]
    out = np.empty((frames, height, width, 3), np.uint8)
    for t in range(frames):
        base = np.stack([xs * 255 // max(1, width - 1), ys * 255 // max(1, height - 1), np.full_like(xs, 40 * t)], -1)
        out[t] = np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
    return out


def _y4m(path: Path, width: int, height: int, rate: str, payload: int) -> Path:
    """A YUV4MPEG2 file: a text header FFmpeg trusts for size and rate, then `payload` bytes of frame data."""
    path.write_bytes(f"YUV4MPEG2 W{width} H{height} F{rate} Ip A1:1 C420jpeg\nFRAME\n".encode() + bytes(payload))
    return path


def _audio_only(path: Path) -> Path:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=44100, layout="mono")
        samples = av.AudioFrame.from_ndarray(np.zeros((1, 4410), np.float32), format="fltp", layout="mono")
        samples.sample_rate, samples.pts = 44100, 0
        container.mux(stream.encode(samples))
        container.mux(stream.encode(None))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from PIL import Image

    root = tmp_path_factory.mktemp("corpus")
    files: dict[str, Path] = {}
    files["one"] = make_sample_clip(root / "one.mp4", width=64, height=64, num_frames=1)
    files["eight"] = make_sample_clip(root / "eight.mp4", width=64, height=64, num_frames=8, audio=False)
    files["zero"] = root / "zero.mp4"
    files["zero"].touch()
    files["random"] = root / "random.mp4"
    files["random"].write_bytes(np.random.default_rng(7).integers(0, 256, 65536, dtype=np.uint8).tobytes())
    # Nine all-intra frames, once with the index at the end (as recorders write) and once at the front.
    plain = _encode(root / "nine-plain.mp4", frames=9, options={"g": "1"})
    fast = _encode(root / "nine-fast.mp4", frames=9, options={"g": "1"}, container_options={"movflags": "+faststart"})
    for name, source, cut in [
        ("cut-plain-10", plain, 0.10),
        ("cut-plain-50", plain, 0.50),
        ("cut-plain-99", plain, 0.99),
    ]:
        data = source.read_bytes()
        files[name] = root / f"{name}.mp4"
        files[name].write_bytes(data[: int(len(data) * cut)])
    # The front-indexed file cut at points of its structure: in the track header, in the sample description, after
    # the index, in the first frame, and after a few frames.
    data = fast.read_bytes()
    for name, cut in [
        ("cut-fast-trak", data.find(b"trak") + 50),
        ("cut-fast-stsd", data.find(b"stsd") - 20),
        ("cut-fast-index", data.find(b"stco") + 10),
        ("cut-fast-mdat", data.find(b"mdat") + 100),
        ("cut-fast-60", int(len(data) * 0.60)),
    ]:
        files[name] = root / f"{name}.mp4"
        files[name].write_bytes(data[:cut])
    files["audio-only"] = _audio_only(root / "sound.m4a")
    files["png"] = root / "still.png"
    Image.fromarray(make_frames(64, 64, 1)[0]).save(files["png"])
    files["absurd-fps"] = _y4m(root / "absurd-fps.y4m", 64, 64, "100000:1", 64 * 64 * 3 // 2)
    files["one-at-60"] = _encode(root / "one-at-60.mkv", codec="ffv1", rate=60)
    files["raw-h264"] = _encode(root / "raw.h264", fmt="h264")
    files["vfr"] = _encode(root / "vfr.mkv", codec="ffv1", frames=9, pts_ms=[0, 30, 60, 130, 170, 210, 290, 330, 375])
    files["ten-bit"] = _encode(root / "ten-bit.mp4", pix_fmt="yuv420p10le")
    files["alpha"] = _encode(root / "alpha.mov", codec="png", pix_fmt="rgba")
    files["rotated"] = _encode(root / "rotated.mp4", rotation=90)
    files["odd"] = _encode(root / "odd.mkv", codec="ffv1", width=257, height=161)
    files["below-tile"] = _encode(root / "below-tile.mkv", codec="ffv1", width=33, height=17)
    files["huge"] = _y4m(root / "huge.y4m", 9000, 9000, "24:1", 4096)
    files["directory"] = root / "folder.mp4"
    files["directory"].mkdir()
    files["fifo"] = root / "pipe.mp4"
    os.mkfifo(files["fifo"])
    return files


# ------------------------------------------------------------------------------------------------ running the CLI


@dataclass
class Result:
    rc: int
    out: str
    err: str
    out_dir: Path
    store: Path
    model_loads: int

    @property
    def message(self) -> str:
        lines = [line for line in self.err.splitlines() if line.startswith("k6vsr: error:")]
        assert len(lines) == 1, self.err
        return lines[0]

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads(self.out)


class Cli:
    def __init__(self, tmp_path: Path, bundle: Path, capsys: pytest.CaptureFixture, loads: list[int]) -> None:
        self.tmp, self.bundle, self.capsys, self.loads = tmp_path, bundle, capsys, loads
        self.out_dir, self.store = tmp_path / "out", tmp_path / "store"

    def __call__(self, command: str, source: Path | str, *extra: str, out_dir: Path | None = None) -> Result:
        argv = [command, str(source), "--model", str(self.bundle), "--store", str(self.store), "--json"]
        if command == "upscale":
            argv += ["-o", str(out_dir or self.out_dir), "--device", "cpu"]
        self.capsys.readouterr()
        before = self.loads[0]
        try:
            rc = main([*argv, *extra])
        except SystemExit as exit_:  # argparse
            rc = int(exit_.code or 0)
        captured = self.capsys.readouterr()
        return Result(rc, captured.out, captured.err, out_dir or self.out_dir, self.store, self.loads[0] - before)


@pytest.fixture
def cli(tmp_path: Path, tiny_bundle_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Cli:
    """`main([...])` in-process, counting every model load a stage asks for."""
    import tasks.model_cache as model_cache

    loads = [0]
    original = model_cache.get_bundle

    def counting(spec: Any, plan: Any = None) -> Any:
        loads[0] += 1
        return original(spec, plan)

    monkeypatch.setattr(model_cache, "get_bundle", counting)
    return Cli(tmp_path, tiny_bundle_path, capsys, loads)


def files_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*")) if folder.exists() else []


def assert_refused(result: Result, *causes: str, names: Path | str | None = None) -> None:
    assert result.rc == 2, (result.rc, result.err[-3000:])
    assert "Traceback" not in result.err, result.err[-3000:]
    message = result.message
    if names is not None:
        assert str(names) in message, message
    for cause in causes:
        assert cause in message, message
    assert result.model_loads == 0, "a model was loaded for a refused input"
    assert files_in(result.store / "runs") == [], "a run was started in the store"
    assert [p for p in files_in(result.out_dir) if p.is_file()] == [], "something was written to the output folder"


def assert_runs(
    result: Result, source: Path, tiny_bundle: Any, *, frames: int, fps: int, scale: float = 2.0
) -> dict[str, Any]:
    """The run succeeded, wrote one complete file and nothing else, equal to the in-memory runner's output."""
    assert result.rc == 0, result.err[-3000:]
    summary = result.summary
    output = Path(summary["output"])
    assert [p for p in files_in(result.out_dir)] == [output], files_in(result.out_dir)
    assert (summary["frames"], summary["fps"]) == (frames, fps)
    info = media.probe(output)
    width, height = summary["size"]
    assert (info.width, info.height) == (width + width % 2, height + height % 2)
    assert info.num_frames == frames
    reference = result.out_dir.parent / "reference.mp4"
    ran = upscale(source, reference, tiny_bundle, UpscaleParams(scale=scale))
    assert (ran.plan.num_frames, ran.plan.fps) == (frames, fps)
    assert (ran.plan.delivery_size[1], ran.plan.delivery_size[0]) == (width, height)
    assert output.read_bytes() == reference.read_bytes(), "the flow's output differs from the in-memory runner's"
    assert fault_harness.leftovers(result.out_dir, result.store) == []
    return summary


# ------------------------------------------------------------------------------------------------ unusable files


REFUSED_FILES = [
    ("zero", ["empty file (0 bytes)"]),
    ("random", ["not a readable media file"]),
    ("cut-plain-10", ["not a readable media file"]),
    ("cut-plain-50", ["not a readable media file"]),
    ("cut-plain-99", ["video stream has no decodable frames"]),  # the index is cut: tracks, no samples
    ("cut-fast-trak", ["no video stream (found only: data)"]),  # the track's type is cut off
    ("cut-fast-stsd", ["cannot be decoded", "truncated header"]),
    ("cut-fast-index", ["video stream has no decodable frames"]),
    ("cut-fast-mdat", ["could not read the video stream"]),
    ("audio-only", ["no video stream (found only: audio)"]),
    ("absurd-fps", ["frame rate 100000 fps is implausible"]),
    ("one-at-60", ["no frames kept", "1 frame(s) at 60 fps"]),
    ("huge", ["declared resolution 9000x9000 is too large"]),
    ("directory", ["is a directory"]),
    ("fifo", ["is not a regular file (a named pipe)"]),
]


@pytest.mark.parametrize(("name", "causes"), REFUSED_FILES, ids=[name for name, _ in REFUSED_FILES])
def test_unusable_file_is_refused_before_model_work(cli: Cli, corpus: dict[str, Path], name: str, causes: list[str]):
    source = corpus[name]
    assert_refused(cli("upscale", source, *SCALE2), *causes, names=source)


def test_missing_path(cli: Cli, tmp_path: Path) -> None:
    source = tmp_path / "nowhere" / "clip.mp4"
    assert_refused(cli("upscale", source), "no such file", names=source)


def test_device_file_is_refused(cli: Cli) -> None:
    assert_refused(cli("upscale", "/dev/zero"), "is not a regular file (a device)", names="/dev/zero")


def test_unreadable_file_emulated(cli: Cli, corpus: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Root reads any file, so `access()` is made to say no for this one path."""
    source = corpus["one"]
    real_access = os.access

    def access(path: Any, mode: int, *args: Any, **kwargs: Any) -> bool:
        if os.fspath(path) == str(source) and mode & os.R_OK:
            return False
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    assert_refused(cli("upscale", source), "permission denied", names=source)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root can read a file with mode 000")
def test_unreadable_file_for_real(cli: Cli, corpus: dict[str, Path], tmp_path: Path) -> None:
    source = tmp_path / "locked.mp4"
    source.write_bytes(corpus["one"].read_bytes())
    source.chmod(0)
    assert_refused(cli("upscale", source), "permission denied", names=source)


@pytest.mark.parametrize(
    ("average", "base", "cause"),
    [
        (Fraction(0), None, "frame rate is unknown"),  # a zero average falls back to the base rate, absent here
        (Fraction(0), Fraction(0), "frame rate 0 fps is not positive"),
        (Fraction(-24), None, "frame rate -24 fps is not positive"),
        (None, None, "frame rate is unknown"),
    ],
    ids=["zero", "zero-both", "negative", "missing"],
)
def test_unusable_frame_rate_stub(
    cli: Cli, corpus: dict[str, Path], monkeypatch: pytest.MonkeyPatch, average: Any, base: Any, cause: str
) -> None:
    """PyAV writes no file with a zero, negative or missing rate: the real file's stream reports one instead."""
    real = probing.video_stream

    class Stream:
        def __init__(self, stream: Any) -> None:
            self._stream = stream
            self.average_rate, self.base_rate = average, base

        def __getattr__(self, name: str) -> Any:
            return getattr(self._stream, name)

    monkeypatch.setattr(probing, "video_stream", lambda container, path: Stream(real(container, path)))
    source = corpus["one"]
    assert_refused(cli("upscale", source), cause, names=source)


def test_plan_refuses_like_upscale(cli: Cli, corpus: dict[str, Path]) -> None:
    result = cli("plan", corpus["zero"])
    assert_refused(result, "empty file", names=corpus["zero"])


# ------------------------------------------------------------------------------------------------ inputs that run


@pytest.mark.parametrize(
    ("name", "frames", "fps"),
    [
        ("one", 1, 24),  # 1 = 1 + 8*0 frames
        ("eight", 8, 24),  # every frame: one window padded to 1 + 8k = 9, cropped back
        ("png", 1, 25),  # a still image is a 1-frame clip; FFmpeg's image reader says 25 fps
        ("raw-h264", 1, 25),  # no timing in the stream: FFmpeg assumes 25 fps
        ("vfr", 9, 22),  # variable frame timing: resampled on its timestamps at its rounded mean rate (21.7 fps)
        ("ten-bit", 1, 24),
        ("alpha", 1, 24),  # alpha is dropped, colour kept
        ("cut-fast-60", 4, 24),  # index intact, frames cut off: the decodable frames, thinned to 24 fps
    ],
)
def test_input_the_contract_covers_runs(
    cli: Cli, corpus: dict[str, Path], tiny_bundle: Any, name: str, frames: int, fps: int
) -> None:
    assert_runs(cli("upscale", corpus[name], *SCALE2), corpus[name], tiny_bundle, frames=frames, fps=fps)


def test_truncated_file_warns_that_frames_are_missing(corpus: dict[str, Path]) -> None:
    """A cut-off file runs on what is there (see above), but never silently."""
    assert media.probe(corpus["cut-fast-60"]).num_frames == 9
    with pytest.warns(UserWarning, match=r"only \d of 9 frame\(s\) could be decoded"):
        clip = read_source(corpus["cut-fast-60"], parse_params(scale=2, frames="contract"), ModelTraits())
    assert clip.plan.num_frames == 1


def test_size_below_one_tile_is_padded_and_cropped_back(cli: Cli, corpus: dict[str, Path], tiny_bundle: Any) -> None:
    """33x17 (odd, smaller than a 64x64 tile) at the default x2.25: padded for the model, cropped after."""
    result = cli("upscale", corpus["below-tile"])
    summary = assert_runs(result, corpus["below-tile"], tiny_bundle, frames=1, fps=24, scale=2.25)
    assert summary["tiles_total"] == 1


def test_odd_size_plan(cli: Cli, corpus: dict[str, Path]) -> None:
    """257x161 is planned with bottom/right padding onto the 16-px stride; no model is needed to see it."""
    result = cli("plan", corpus["odd"], *SCALE2)
    assert result.rc == 0, result.err
    plan = result.summary
    assert plan["source_size"] == {"width": 257, "height": 161}
    assert plan["padding"] == {"bottom": 15, "right": 15}
    assert plan["output_size"] == {"width": 514, "height": 322}
    assert plan["tiles"] == 12 and plan["frames_kept"] == 1


@pytest.fixture(scope="module")
def rotated_run(corpus: dict[str, Path], tiny_bundle_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rotated")
    argv = ["upscale", str(corpus["rotated"]), "--model", str(tiny_bundle_path), "--store", str(out / "store")]
    assert (
        main([*argv, "-o", str(out / "out"), "--output-file-name", "r.mp4", "--json", "--device", "cpu", *SCALE2]) == 0
    )
    return out / "out" / "r.mp4"


def test_rotation_metadata_runs(rotated_run: Path, corpus: dict[str, Path]) -> None:
    """A display matrix does not stop a run: frames are upscaled as stored (64x64 -> 128x128)."""
    assert media.probe(corpus["rotated"]).rotation == 90
    info = media.probe(rotated_run)
    assert (info.width, info.height, info.num_frames) == (128, 128, 1)


def test_rotation_metadata_is_kept(rotated_run: Path) -> None:
    assert media.probe(rotated_run).rotation == 90


# ------------------------------------------------------------------------------------------------ request values


PARAMETER_CASES = [
    (["--scale", "3"], ["scale='3' is not supported"]),
    (["--scale", "two"], ["scale='two' is not a number"]),
    (["--target-resolution", "8k"], ["target_resolution='8k' is not known"]),
    (["--target-resolution", "99999x10"], ["target_resolution='99999x10' is out of range"]),
    (["--target-resize-mode", "stretch"], ["target_resize_mode='stretch'"]),
    (["--num-inference-steps", "0"], ["num_inference_steps=0 is out of range"]),
    (["--tiles-batch-size", "0"], ["tiles_batch_size=0 is out of range"]),
    (["--tile-min-overlap", "1.5"], ["min_overlap=1.5 is out of range"]),
    (["--seed", "-1"], ["seed=-1 is out of range"]),
    (["--attention", "sparse"], ["attention='sparse'"]),
    (["--device", "tpu9"], ["--device 'tpu9' is not a device"]),
    (["--device", "cuda:99"], ["--device 'cuda:99'"]),
    (["--model", "/nonexistent/bundle"], ["/nonexistent/bundle does not exist"]),
]


@pytest.mark.parametrize(("extra", "causes"), PARAMETER_CASES, ids=[" ".join(e) for e, _ in PARAMETER_CASES])
def test_invalid_request_is_refused(cli: Cli, corpus: dict[str, Path], extra: list[str], causes: list[str]) -> None:
    assert_refused(cli("upscale", corpus["one"], *extra), *causes)


def test_exact_target_larger_than_result_is_refused_in_plan_and_upscale(cli: Cli, corpus: dict[str, Path]) -> None:
    """64x64 at x2 is 128x128: an exact 4000x4000 would upscale, which exact mode never does."""
    extra = (*SCALE2, "--target-resolution", "4000x4000", "--target-resize-mode", "exact")
    for command in ("plan", "upscale"):
        assert_refused(cli(command, corpus["one"], *extra), "larger than the SR result 128x128", names=corpus["one"])


def test_unparsable_flag_value_is_a_usage_error(cli: Cli, corpus: dict[str, Path]) -> None:
    result = cli("upscale", corpus["one"], "--seed", "abc")
    assert result.rc == 2 and "invalid int value: 'abc'" in result.err and "Traceback" not in result.err


def test_latent_input_flag_is_not_a_spelling_of_latent() -> None:
    """A latent is `--latent FILE.safetensors` (tests/media/test_latent_input.py); no other spelling is taken."""
    from entrypoints.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["upscale", "x.mp4", "--latent-input", "x.pt"])


# ------------------------------------------------------------------------------------------------ output folders


def test_output_dir_under_a_file(cli: Cli, corpus: dict[str, Path], tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    result = cli("upscale", corpus["one"], out_dir=blocker / "out")
    assert_refused(result, "cannot be created", "Not a directory", names=blocker / "out")
    assert blocker.read_text() == "x"


def test_output_dir_is_a_file(cli: Cli, corpus: dict[str, Path], tmp_path: Path) -> None:
    target = tmp_path / "out.mp4"
    target.write_text("x")
    result = cli("upscale", corpus["one"], out_dir=target)
    assert result.rc == 2 and "is a file" in result.message and str(target) in result.message
    assert target.read_text() == "x" and result.model_loads == 0


def test_output_dir_not_writable_emulated(cli: Cli, corpus: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Root writes anywhere, so `access()` is made to say no for the output folder."""
    out = cli.out_dir
    real_access = os.access

    def access(path: Any, mode: int, *args: Any, **kwargs: Any) -> bool:
        if os.fspath(path) == str(out) and mode & os.W_OK:
            return False
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    assert_refused(cli("upscale", corpus["one"]), "is not writable", names=out)


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A small tmpfs at `path` for real read-only and full-disk cases; skips where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    except OSError as err:
        pytest.skip(f"cannot mount a tmpfs here: {err}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_output_dir_read_only_mount(cli: Cli, corpus: dict[str, Path], tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "ro,size=64k") as mount:
        assert_refused(cli("upscale", corpus["one"], out_dir=mount), "is not writable", names=mount)
        assert_refused(cli("upscale", corpus["one"], out_dir=mount / "sub"), "Read-only file system")


def test_output_dir_on_full_disk_mount(cli: Cli, corpus: dict[str, Path], tmp_path: Path) -> None:
    with tmpfs(tmp_path / "full", "size=64k") as mount:
        (mount / "out").mkdir()
        with contextlib.suppress(OSError), open(mount / "filler", "wb") as handle:
            while True:
                handle.write(b"\0" * 4096)
                handle.flush()
        result = cli("upscale", corpus["one"], out_dir=mount / "out")
        assert_refused(result, "is on a full disk", names=mount / "out")


def test_output_dir_on_full_disk_emulated(cli: Cli, corpus: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=4096))
    assert_refused(cli("upscale", corpus["one"]), "is on a full disk", names=cli.out_dir)


def test_disk_full_while_publishing_leaves_nothing_and_resumes(cli: Cli, corpus: dict[str, Path]) -> None:
    """ENOSPC half-way through the copy into the output folder (after the model work): a clear error naming the
    output, no partial file, and the finished run kept, so the rerun only publishes."""
    destination = cli.out_dir / "one.mp4"
    with fault_harness.faults("nospace@publish"):
        result = cli("upscale", corpus["one"], "--output-file-name", "one.mp4")
    assert result.rc == 2 and "Traceback" not in result.message
    assert str(destination) in result.message and "No space left on device" in result.message
    assert files_in(cli.out_dir) == []
    again = cli("upscale", corpus["one"], "--output-file-name", "one.mp4")
    assert again.rc == 0, again.err[-2000:]
    assert again.summary["reused_output"] is True and again.summary["tiles_computed"] == 0
    assert files_in(cli.out_dir) == [destination]


def test_output_file_that_is_a_directory(cli: Cli, corpus: dict[str, Path]) -> None:
    (cli.out_dir / "taken.mp4").mkdir(parents=True)
    result = cli("upscale", corpus["one"], "--output-file-name", "taken.mp4")
    assert result.rc == 2 and "is a directory" in result.message and result.model_loads == 0
    assert files_in(result.store / "runs") == []


def test_output_file_that_is_the_input(cli: Cli, corpus: dict[str, Path], tmp_path: Path) -> None:
    source = tmp_path / "in" / "clip.mp4"
    source.parent.mkdir()
    source.write_bytes(corpus["one"].read_bytes())
    result = cli("upscale", source, "--output-file-name", "clip.mp4", out_dir=source.parent)
    assert result.rc == 2 and "is the input file" in result.message and result.model_loads == 0
    assert source.read_bytes() == corpus["one"].read_bytes()


# ------------------------------------------------------------------------------------------------ the real command line


def test_command_line_prints_one_line_and_no_traceback(corpus: dict[str, Path], tmp_path: Path) -> None:
    """The installed entry point, in a subprocess: exit 2, one line, no traceback; `--debug` shows the traceback."""
    common = ["--store", str(tmp_path / "store"), "-o", str(tmp_path / "out")]
    plain, debug = fault_harness.run_all(
        [
            fault_harness.command("upscale", str(corpus["random"]), *common),
            fault_harness.command("upscale", str(corpus["random"]), *common, "--debug"),
        ],
        parallel=2,
    )
    assert plain.returncode == 2, plain.stderr
    assert plain.stderr.strip().splitlines() == [
        f"k6vsr: error: {corpus['random']}: not a readable media file (Invalid data found when processing input)"
    ]
    assert plain.stdout == ""
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "MediaError" in debug.stderr
    assert files_in(tmp_path / "out") == [] and files_in(tmp_path / "store" / "runs") == []


def test_debug_flag_raises_in_process(cli: Cli, corpus: dict[str, Path]) -> None:
    with pytest.raises(MediaError, match="empty file"):
        main(["upscale", str(corpus["zero"]), "--debug", "--store", str(cli.store)])


def test_rotated_output_equals_the_in_memory_runner(
    rotated_run: Path, corpus: dict[str, Path], tiny_bundle_path: Path, tmp_path: Path
) -> None:
    from k6vsr_core import UpscaleParams, load_bundle, upscale

    reference = tmp_path / "ref.mp4"
    upscale(corpus["rotated"], reference, load_bundle(str(tiny_bundle_path)), UpscaleParams(scale=2))
    assert media.probe(reference).rotation == 90
    assert reference.read_bytes() == rotated_run.read_bytes()
