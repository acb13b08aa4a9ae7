"""Interlaced sources: their field order found (the stream's flags, else combing in the picture), their frames
deinterlaced by bwdif before the model, `k6vsr plan` saying so, and the run key following the frames."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest
from media_kit import interlaced_frames, write_interlaced

from entrypoints.cli import main
from k6vsr_core import UpscaleParams, media
from k6vsr_core.contract.params import parse_params
from k6vsr_core.errors import ParameterError
from k6vsr_core.media.sample import make_sample_clip
from k6vsr_core.model.bundle import model_traits
from k6vsr_core.model.runner import read_source, read_window
from storage import run_key, source_info

SIZE = 64
FRAMES = 9
RATE = 25


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("interlaced")
    return {
        "tff": write_interlaced(folder / "tff.mp4", interlaced_frames(FRAMES, top_first=True), "tff"),
        "bff": write_interlaced(folder / "bff.mp4", interlaced_frames(FRAMES, top_first=False), "bff"),
        # A capture encoded progressive: the stream says progressive, the picture is combed (bottom field first).
        "unflagged": write_interlaced(folder / "unflagged.mp4", interlaced_frames(FRAMES, top_first=False), None),
        "progressive": make_sample_clip(folder / "progressive.mp4", width=SIZE, height=SIZE, num_frames=FRAMES),
    }


def combing(frames: np.ndarray) -> float:
    """Line-to-line difference energy: the mean squared difference between neighbouring lines (which belong to
    different fields), over the mean squared difference two lines apart (the same field). Near or below 1 for a
    progressive picture; combing, whose neighbouring lines show different instants, makes it large."""
    luma = frames.astype(np.float64).mean(axis=-1)
    neighbours = np.square(np.diff(luma, axis=1)).mean()
    same_field = np.square(luma[:, 2:] - luma[:, :-2]).mean()
    return float(neighbours / max(same_field, 1.0))


# ------------------------------------------------------------------------------------------------ detection


@pytest.mark.parametrize("order", ["tff", "bff"])
def test_the_field_order_is_read_from_the_stream(sources: dict[str, Path], order: str) -> None:
    found = media.probe_fields(sources[order])
    assert (found.stream, found.found_by, found.order) == (order, "stream", order)
    # The picture agrees: idet sees the same order in the pixels.
    assert getattr(found, f"picture_{order}") == FRAMES


def test_a_combed_source_coded_progressive_is_found_by_its_picture(sources: dict[str, Path]) -> None:
    found = media.probe_fields(sources["unflagged"])
    assert (found.stream, found.found_by, found.order) == ("progressive", "picture", "bff")


def test_a_progressive_source_is_not_interlaced(sources: dict[str, Path]) -> None:
    found = media.probe_fields(sources["progressive"])
    assert (found.found_by, found.order) == (None, None)
    assert found.picture_progressive == FRAMES


# ------------------------------------------------------------------------------------------------ the frames


@pytest.mark.parametrize("name", ["tff", "bff", "unflagged"])
def test_no_combed_frame_reaches_the_model(sources: dict[str, Path], tiny_bundle, name: str) -> None:
    combed = media.read_frames(sources[name], list(range(FRAMES)))
    assert combing(combed) > 50
    clip = read_source(sources[name], UpscaleParams(scale=2), model_traits(tiny_bundle.info))
    assert clip.plan.deinterlace == media.probe_fields(sources[name]).order
    seen = read_window(clip, clip.plan.windows[0])
    assert seen.shape == combed.shape and combing(seen) < 2
    # Off, the frames are read as they are.
    kept = read_source(sources[name], UpscaleParams(scale=2, deinterlace="off"), model_traits(tiny_bundle.info))
    assert kept.plan.deinterlace is None and np.array_equal(read_window(kept, kept.plan.windows[0]), combed)


def test_a_window_read_by_seeking_is_the_frames_of_a_whole_read(sources: dict[str, Path]) -> None:
    """bwdif makes a frame with its neighbours: a window that starts mid-clip feeds the one before it first."""
    count, stamps = media.scan_frames(sources["tff"])
    whole = media.read_frames(sources["tff"], list(range(count)), None, "tff")
    assert np.array_equal(media.read_frames(sources["tff"], list(range(3, count)), stamps, "tff"), whole[3:])
    assert np.array_equal(np.stack(list(media.iter_frames(sources["tff"], list(range(count)), fields="tff"))), whole)


def test_bwdif_deinterlaces_a_progressive_source_when_asked(sources: dict[str, Path], tiny_bundle) -> None:
    traits = model_traits(tiny_bundle.info)
    assert read_source(sources["progressive"], UpscaleParams(scale=2), traits).plan.deinterlace is None
    forced = read_source(sources["progressive"], UpscaleParams(scale=2, deinterlace="bwdif"), traits)
    assert forced.plan.deinterlace == "tff"


def test_bwdif_refuses_frames_too_small_for_it(tiny_bundle) -> None:
    from k6vsr_core.contract.plan import make_plan

    fields = media.FieldInfo(stream="tff", analysed=1)
    with pytest.raises(ParameterError, match=r"^deinterlace=auto needs frames of at least 3 lines.*64x2"):
        make_plan((2, 64), 1, 25.0, UpscaleParams(scale=2), model_traits(tiny_bundle.info), fields=fields)
    assert make_plan((2, 64), 1, 25.0, UpscaleParams(scale=2, deinterlace="off"), fields=fields).deinterlace is None


def test_an_unknown_mode_is_refused_naming_the_field() -> None:
    with pytest.raises(ParameterError, match=r"^deinterlace="):
        parse_params(deinterlace="yadif")
    from entrypoints.server.fields import params_from_fields

    assert params_from_fields({"deinterlace": "off"}).deinterlace == "off"


def test_a_stream_whose_flags_contradict_its_picture_is_warned_of(tmp_path: Path, tiny_bundle) -> None:
    """Bottom-first fields signalled top first: the stream is believed, and the plan says the picture disagrees."""
    source = write_interlaced(tmp_path / "mislabelled.mp4", interlaced_frames(FRAMES, top_first=False), "tff")
    found = media.probe_fields(source)
    assert found.order == "tff" and found.picture_disagrees and "shows the other order" in found.describe()
    with pytest.warns(UserWarning, match="the picture shows the other order"):
        read_source(source, UpscaleParams(scale=2), model_traits(tiny_bundle.info))


# ------------------------------------------------------------------------------------------------ plan and run key


def _plan(source: Path, bundle: Path, store: Path, capsys, *extra: str) -> dict:
    assert main(["plan", str(source), "--model", str(bundle), "--store", str(store), "--scale", "2", *extra]) == 0
    return json.loads(capsys.readouterr().out) if "--json" in extra else {"text": capsys.readouterr().out}


def test_plan_says_what_it_found(sources: dict[str, Path], tiny_bundle_path: Path, tmp_path: Path, capsys) -> None:
    shown = _plan(sources["bff"], tiny_bundle_path, tmp_path, capsys, "--json")["interlacing"]
    assert shown["interlaced"] and shown["field_order"] == "bff" and shown["found_by"] == "stream"
    assert shown["filter"] == "bwdif=mode=send_frame:parity=bff:deint=all" and shown["deinterlace"] == "auto"
    assert shown["picture"]["bff"] == FRAMES

    text = _plan(sources["unflagged"], tiny_bundle_path, tmp_path, capsys)["text"]
    line = next(line for line in text.splitlines() if line.startswith("fields"))
    assert "interlaced, bottom field first, found by the picture" in line and "deinterlaced (bwdif=" in line

    off = _plan(sources["unflagged"], tiny_bundle_path, tmp_path, capsys, "--json", "--deinterlace", "off")
    assert off["interlacing"]["interlaced"] and off["interlacing"]["filter"] is None

    progressive = _plan(sources["progressive"], tiny_bundle_path, tmp_path, capsys, "--json")["interlacing"]
    assert not progressive["interlaced"] and progressive["filter"] is None


def test_the_run_key_follows_the_frames(sources: dict[str, Path], tiny_bundle_path: Path, tmp_path: Path) -> None:
    from service.runs import ModelSpec, prepare_run

    spec = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    params = UpscaleParams(scale=2)

    def key(name: str, **values: object) -> str:
        return prepare_run(sources[name], params.model_copy(update=values), spec, tmp_path).run.run_key

    identity = prepare_run(sources["progressive"], params, spec, tmp_path).model_info.identity
    # A progressive source keeps the key it had before deinterlacing existed, whatever the mode reads it as.
    before = run_key(source_info(sources["progressive"]).sha256, params, identity)
    assert key("progressive") == key("progressive", deinterlace="off") == before
    assert key("progressive", deinterlace="bwdif") != before
    # An interlaced source's deinterlaced frames are another run than its combed ones (and than earlier runs).
    combed = run_key(source_info(sources["tff"]).sha256, params, identity)
    assert key("tff") == key("tff", deinterlace="bwdif") != combed
    assert key("tff", deinterlace="off") == combed


# ------------------------------------------------------------------------------------------------ upscale


def test_upscale_runs_the_model_on_the_deinterlaced_frames(
    sources: dict[str, Path], tiny_bundle_path: Path, tmp_path: Path
) -> None:
    """`k6vsr upscale` of an interlaced source writes what the same command writes of a lossless progressive copy of
    its deinterlaced frames: the model saw those frames, and no combed one."""
    deinterlaced = media.read_frames(sources["tff"], list(range(FRAMES)), None, "tff")
    copy = tmp_path / "progressive_copy.mkv"
    with av.open(str(copy), "w") as container:
        stream = container.add_stream("ffv1", rate=RATE)
        stream.width = stream.height = SIZE
        stream.pix_fmt = "bgr0"
        for image in deinterlaced:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode(None))
    assert np.array_equal(media.read_frames(copy, list(range(FRAMES))), deinterlaced)

    def upscale(source: Path, name: str) -> np.ndarray:
        argv = ["upscale", str(source), "--model", str(tiny_bundle_path), "--store", str(tmp_path / "store")]
        argv += ["-o", str(tmp_path / "out"), "--output-file-name", name, "--device", "cpu", "--scale", "2"]
        assert main([*argv, "--codec", "ffv1", "--audio", "none"]) == 0
        return media.read_frames(tmp_path / "out" / name, list(range(FRAMES)))

    upscaled = upscale(sources["tff"], "interlaced.mkv")
    assert upscaled.shape == (FRAMES, 2 * SIZE, 2 * SIZE, 3)
    assert np.array_equal(upscaled, upscale(copy, "copy.mkv"))
