"""Latent input through the command line, the flow and the HTTP API.

The latent is the one our own encode stage writes (`stages.encode_latent`) of a 1-frame 64x64 clip: 1 tile at x2,
9 at x4 with the tiny bundle. Its output must be the output of the clip, byte for byte; every refusal is one line
(or one JSON error) and leaves nothing behind: no output file, no run in the store, no job.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import torch
from http_harness import Server, completed, error_of
from safetensors.torch import save_file

from entrypoints.cli import main
from k6vsr_core import UpscaleParams
from k6vsr_core.contract.latent import fit_latent, load_latent
from k6vsr_core.errors import ParameterError
from k6vsr_core.media.sample import make_sample_clip
from k6vsr_core.model import stages
from k6vsr_core.model.bundle import ModelBundle, model_traits
from k6vsr_core.model.runner import read_source, read_window
from service.runs import ModelSpec, prepare_run
from storage import RunStore


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: ModelBundle, tiny_bundle_path: Path) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("latent-input")
    video = make_sample_clip(root / "clip.mp4", width=64, height=64, num_frames=1)
    # The latent does not depend on the scale: x2 and x4 pad and encode the same pixels.
    params = UpscaleParams(scale=2, audio="none")
    clip = read_source(video, params, model_traits(tiny_bundle.info))
    window = clip.plan.windows[0]
    latent = stages.encode_latent(tiny_bundle, stages.prepare_window(read_window(clip, window), clip.plan, window))
    assert tuple(latent.shape) == (1, 64, 4, 4)
    good = root / "clip.safetensors"
    save_file({"sr_lr_latent": latent}, str(good))
    bad = {
        "channels": {"x": torch.zeros(1, 16, 4, 4)},
        "dtype": {"x": torch.zeros(1, 64, 4, 4, dtype=torch.int32)},
        "even": {"x": torch.zeros(2, 64, 4, 4)},
        "many": {"x": torch.zeros(33, 64, 4, 4)},
        "two": {"a": latent, "b": latent.clone()},
    }
    files = {}
    for name, tensors in bad.items():
        files[name] = root / f"{name}.safetensors"
        save_file(tensors, str(files[name]))
    files["text"] = root / "text.safetensors"
    files["text"].write_text("not a safetensors file")
    return {"root": root, "video": video, "latent": good, "bad": files, "bundle": tiny_bundle_path}


def _cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = main([str(arg) for arg in argv])
    except SystemExit as exit_:  # argparse
        rc = int(exit_.code or 0)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _model(case: dict[str, Any], store: Path) -> list[str]:
    return ["--model", str(case["bundle"]), "--store", str(store), "--json"]


def _audio_streams(path: Path) -> int:
    with av.open(str(path)) as container:
        return len(container.streams.audio)


@pytest.mark.parametrize("scale", [2, 4])
def test_a_latent_from_our_encode_stage_gives_the_output_of_its_video(
    case: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    caplog: pytest.LogCaptureFixture,
    prefect_server: str,
    scale: int,
) -> None:
    run = [*_model(case, tmp_path / "store"), "--device", "cpu", "--scale", str(scale), "-o", str(tmp_path)]
    rc, out, err = _cli(["upscale", case["video"], "--audio", "none", "--output-file-name", "video", *run], capsys)
    assert rc == 0, err
    latent = ["upscale", "--latent", case["latent"], "--fps", "24", "--output-file-name", "latent", *run]
    rc, out, err = _cli(latent, capsys)
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["source"] == str(case["latent"].resolve()) and summary["frames"] == 1
    assert summary["output_format"]["audio"] == "none" and summary["output_format"]["frame_rate"] == "24"
    assert (tmp_path / "latent.mp4").read_bytes() == (tmp_path / "video.mp4").read_bytes()
    assert _audio_streams(tmp_path / "latent.mp4") == 0  # silent without --audio FILE
    assert "could not publish the report artifact" not in caplog.text  # a report without a source still

    # Resumed as a video run is: the same latent and rate are the same run, whose output is published again.
    (tmp_path / "latent.mp4").unlink()
    rc, out, err = _cli(latent, capsys)
    again = json.loads(out)
    assert rc == 0 and again["run_key"] == summary["run_key"] and again["reused_output"], err
    assert (
        again["tiles_computed"] == 0 and (tmp_path / "latent.mp4").read_bytes() == (tmp_path / "video.mp4").read_bytes()
    )


def test_audio_file_is_muxed_and_the_default_name_is_beside_the_latent(
    case: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture, prefect_server: str
) -> None:
    latent = tmp_path / "shot.safetensors"
    latent.write_bytes(case["latent"].read_bytes())
    argv = ["upscale", "--latent", latent, "--fps", "30000/1001", "--scale", "2", "--audio", case["video"]]
    rc, out, err = _cli([*argv, *_model(case, tmp_path / "store"), "--device", "cpu"], capsys)
    assert rc == 0, err
    output = Path(json.loads(out)["output"])
    assert output.parent == tmp_path and output.name.startswith("shot_sr2x_") and output.suffix == ".mp4"
    assert _audio_streams(output) == 1
    with av.open(str(output)) as container:
        assert container.streams.video[0].average_rate == Fraction(30000, 1001)


def _refusals(case: dict[str, Any]) -> list[tuple[list[Any], str]]:
    latent, bad, video = case["latent"], case["bad"], case["video"]
    at = ["--scale", "2", "--fps", "24"]
    return [
        (["--latent", latent, "--scale", "2.25", "--fps", "24"], "pre-upscale"),
        (["--latent", bad["channels"], *at], "16 channels"),
        (["--latent", bad["dtype"], *at], "dtype torch.int32"),
        (["--latent", bad["even"], *at], "2 frames; allowed: an odd count"),
        (["--latent", bad["many"], *at], "33 frames; allowed: an odd count from 1 to 31"),
        (["--latent", bad["two"], *at], "holds 2 tensors"),
        (["--latent", bad["text"], *at], "not a readable safetensors file"),
        (["--latent", case["root"] / "missing.safetensors", *at], "no such file"),
        (["--latent", latent, "--scale", "2"], "--latent needs --fps RATE"),
        (["--latent", latent, "--scale", "2", "--fps", "source"], "--fps is the latent's frame rate"),
        (["--latent", latent, "--scale", "2", "--fps", "fast"], "fps='fast' is not a number"),
        (["--latent", latent, "--scale", "2", "--fps", "0"], "out of range"),
        ([video, "--latent", latent, *at], "not both"),
        (["--scale", "2"], "give a video to upscale, or --latent"),
        ([video, "--scale", "2", "--fps", "24"], "a frame rate is given only with --latent"),
    ]


def test_every_refusal_is_one_line_with_nothing_written(
    case: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    store, out = tmp_path / "store", tmp_path / "out"
    for extra, words in _refusals(case):
        for command in ("upscale", "plan"):
            argv = [command, *extra, *_model(case, store)]
            if command == "upscale":
                argv += ["-o", str(out), "--device", "cpu"]
            rc, stdout, err = _cli(argv, capsys)
            lines = err.strip().splitlines()
            assert rc == 2 and stdout == "" and len(lines) == 1, (extra, err)
            assert lines[0].startswith("k6vsr: error:") and words in lines[0], (extra, lines[0])
            assert not out.exists() and not (store / "runs").exists(), extra


def test_the_run_key_holds_the_latents_content_and_rate(
    case: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    other = tmp_path / "other.safetensors"
    save_file({"sr_lr_latent": torch.ones(1, 64, 4, 4)}, str(other))

    def key(*argv: Any) -> str:
        rc, out, err = _cli(["plan", *argv, "--scale", "2", *_model(case, tmp_path / "store")], capsys)
        assert rc == 0, err
        return json.loads(out)["run_key"]

    first = key("--latent", case["latent"], "--fps", "24")
    assert key("--latent", case["latent"], "--fps", "24/1", "--audio", "contract") == first  # the same run
    keys = {
        first,
        key("--latent", case["latent"], "--fps", "25"),
        key("--latent", other, "--fps", "24"),
        key(case["video"], "--audio", "none"),
    }
    assert len(keys) == 4
    assert not (tmp_path / "store").exists()  # planning writes nothing


def test_a_resumed_latent_run_reads_the_latent_where_it_is_now(
    case: dict[str, Any], tiny_bundle: ModelBundle, tmp_path: Path
) -> None:
    """Ingest done from one path, the same latent resumed from another (a resubmitted HTTP job has its own copy):
    the encode stage reads the latent at its new path, scaled and fitted as the Python API does; a latent changed
    since ingest is refused."""
    from tasks import ingest, stage_tasks

    spec = ModelSpec(model=str(case["bundle"]), device="cpu")
    store_root, first, second = tmp_path / "store", tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    first.write_bytes(case["latent"].read_bytes())
    prepared = prepare_run(first, UpscaleParams(scale=2), spec, store_root, "24")
    run = prepared.run
    assert ingest.ingest.fn(prepared, "one").computed
    first.rename(second)
    again = prepare_run(second, UpscaleParams(scale=2), spec, store_root, "24")
    assert again.run == run
    assert not ingest.ingest.fn(again, "two").computed
    store = RunStore(store_root, run.run_key)
    assert store.read_manifest().source.path == str(second.resolve())
    assert store.get("frame_pts", stage="ingest") is None  # no source frames to index

    assert stage_tasks.encode.fn(run, spec, 0, "two").computed
    expected = fit_latent(stages.scale_latent(tiny_bundle, load_latent(second)), prepared.plan)
    assert np.array_equal(store.get_tile("latent", (0,), stage="encode"), expected.numpy())

    store.drop_window(("latent",), 0)
    save_file({"sr_lr_latent": torch.ones(1, 64, 4, 4)}, str(second))
    with pytest.raises(ParameterError, match="changed since the run was planned"):
        stage_tasks.encode.fn(run, spec, 0, "three")
    # Ingest records the plan it is handed: a latent reshaped since that plan was made is refused before anything
    # is recorded.
    save_file({"sr_lr_latent": torch.ones(1, 64, 8, 8)}, str(second))  # another size: another plan
    elsewhere = again.run.model_copy(update={"store_root": str(tmp_path / "other")})
    with pytest.raises(ParameterError, match="changed since the run was planned"):
        ingest.ingest.fn(again.model_copy(update={"run": elsewhere}), "four")
    assert not (tmp_path / "other").exists() or not any((tmp_path / "other").rglob("manifest*"))


# ------------------------------------------------------------------------------------------------ HTTP


@pytest.fixture(scope="module")
def server(case: dict[str, Any], prefect_server: str):
    running = Server(case["root"], case["root"] / "store", case["bundle"], "server", ["--max-upload-mb", "1"], None)
    running.start()
    yield running
    running.stop()


def _post_latent(server: Server, data: bytes, **fields: Any) -> Any:
    files = {"latent_reference": ("x.safetensors", data, "application/octet-stream")}
    return server.client.post("/v1/videos", files=files, data={k: str(v) for k, v in fields.items()})


def test_an_uploaded_latent_gives_the_output_of_its_video(server: Server, case: dict[str, Any], tmp_path: Path) -> None:
    by_latent = completed(server, _post_latent(server, case["latent"].read_bytes(), fps=24, sr_resolution_scale=2))
    by_video = completed(server, server.post_upload(case["video"], sr_resolution_scale=2, audio="none"))
    assert by_latent["source"] == {"type": "latent"} and by_latent["output"]["has_audio"] is False
    assert by_latent["size"] == "128x128" and by_latent["output"]["frames"] == 1
    a = server.content(by_latent["id"], tmp_path / "latent.mp4")
    b = server.content(by_video["id"], tmp_path / "video.mp4")
    assert a.read_bytes() == b.read_bytes()


def test_uploaded_latents_are_refused_with_their_field(server: Server, case: dict[str, Any]) -> None:
    jobs = case["root"] / "store" / "jobs"
    before = sorted(p.name for p in jobs.iterdir())
    secrets = [str(case["root"]), str(case["root"].resolve())]
    good = case["latent"].read_bytes()
    for data, fields, param, code in [
        (good, {"sr_resolution_scale": 2}, "fps", "missing_fps"),
        (good, {"sr_resolution_scale": 2, "fps": "fast"}, "fps", "invalid_value"),
        (good, {"sr_resolution_scale": 2.25, "fps": 24}, "sr_resolution_scale", "invalid_value"),
        (good, {"sr_resolution_scale": 2, "fps": 24, "fps_mode": "source"}, "fps_mode", "conflicting_fields"),
        (case["bad"]["channels"].read_bytes(), {"sr_resolution_scale": 2, "fps": 24}, "latent_reference", None),
        (case["bad"]["two"].read_bytes(), {"sr_resolution_scale": 2, "fps": 24}, "latent_reference", None),
        (b"not a latent", {"sr_resolution_scale": 2, "fps": 24}, "latent_reference", None),
    ]:
        error = error_of(_post_latent(server, data, **fields), 400, secrets)
        assert error["param"] == param and error["code"] == (code or "invalid_latent"), (fields, error)
        assert "\n" not in error["message"]
    channels = error_of(_post_latent(server, case["bad"]["channels"].read_bytes(), fps=24, sr_resolution_scale=2), 400)
    assert "16 channels" in channels["message"]

    both = {
        "video_reference": ("c.mp4", case["video"].read_bytes(), "video/mp4"),
        "latent_reference": ("x.safetensors", good, "application/octet-stream"),
    }
    error = error_of(server.client.post("/v1/videos", files=both, data={"fps": "24"}), 400)
    assert error["code"] == "conflicting_inputs"
    error = error_of(server.post_upload(case["video"], sr_resolution_scale=2, fps=24), 400)
    assert error["param"] == "fps" and error["code"] == "unexpected_field"
    error = error_of(server.post_json(latent_reference="x.safetensors", fps=24), 400)
    assert error["param"] == "latent_reference"
    too_big = bytes((1 << 20) + 1000)  # over the 1 MB upload limit, within the request's
    error = error_of(_post_latent(server, too_big, fps=24, sr_resolution_scale=2), 413)
    assert error["param"] == "latent_reference" and error["code"] == "file_too_large"

    assert sorted(p.name for p in jobs.iterdir()) == before  # nothing left of any refused request
