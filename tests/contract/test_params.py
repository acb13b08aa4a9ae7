"""Tests for k6vsr_core.contract.params: official defaults and one ParameterError per invalid request value."""

from __future__ import annotations

import pydantic
import pytest

from k6vsr_core.contract.params import ParameterError, UpscaleParams, parse_params


def test_defaults_are_the_official_ones() -> None:
    params = parse_params()
    assert params.scale == 2.25
    assert params.num_inference_steps is None
    assert params.tiles_batch_size == 1
    assert params.min_overlap == 0.2
    assert params.seed == 42
    assert params.target_resolution is None
    assert params.target_resize_mode == "fit"
    assert params.attention == "nabla"
    # x2.25 is the x2 path after a 1.125 pre-upscale.
    assert params.tiling_scale == 2
    assert params.pre_upscale is True
    assert params.scale_label == "2.25"


@pytest.mark.parametrize(
    ("scale", "tiling_scale", "pre_upscale", "label"),
    [(2, 2, False, "2"), ("2", 2, False, "2"), (4.0, 4, False, "4"), ("2.25", 2, True, "2.25")],
)
def test_valid_scales(scale: object, tiling_scale: int, pre_upscale: bool, label: str) -> None:
    params = parse_params(scale=scale)
    assert params.tiling_scale == tiling_scale
    assert params.pre_upscale is pre_upscale
    assert params.scale_label == label


@pytest.mark.parametrize(
    ("value", "stored"),
    [
        (None, None),
        ("none", None),
        ("", None),
        (" HD ", "hd"),
        ("fullhd", "fullhd"),
        ("2K", "2k"),
        ("1280X720", "1280x720"),
        (" 640 x 360 ", "640x360"),
    ],
)
def test_target_resolution_is_normalised(value: object, stored: str | None) -> None:
    assert parse_params(target_resolution=value).target_resolution == stored


def test_params_are_frozen() -> None:
    params = parse_params()
    with pytest.raises(pydantic.ValidationError):
        params.seed = 7  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("scale", 3, "scale=3"),
        ("scale", "abc", "scale='abc'"),
        ("scale", 1.5, "scale=1.5"),
        ("min_overlap", 1.0, "min_overlap=1.0"),
        ("min_overlap", -0.1, "min_overlap=-0.1"),
        ("tiles_batch_size", 0, "tiles_batch_size=0"),
        ("tiles_batch_size", 65, "tiles_batch_size=65"),
        ("seed", -1, "seed=-1"),
        ("num_inference_steps", 0, "num_inference_steps=0"),
        ("target_resolution", "4k", "target_resolution='4k'"),
        ("target_resolution", "0x0", "target_resolution='0x0'"),
        ("target_resolution", "20000x100", "target_resolution='20000x100'"),
        ("target_resolution", 720, "target_resolution=720"),
        ("target_resize_mode", "stretch", "target_resize_mode='stretch'"),
        ("attention", "flash", "attention='flash'"),
    ],
)
def test_invalid_value_names_field_and_value(field: str, value: object, shown: str) -> None:
    with pytest.raises(ParameterError) as caught:
        parse_params(**{field: value})
    assert shown in str(caught.value)


def test_unknown_field_is_refused_by_name() -> None:
    with pytest.raises(ParameterError) as caught:
        parse_params(tile_size=512)
    message = str(caught.value)
    assert "tile_size" in message
    assert "512" in message


def test_every_invalid_field_is_reported() -> None:
    with pytest.raises(ParameterError) as caught:
        parse_params(scale=3, seed=-1)
    message = str(caught.value)
    assert "scale=3" in message
    assert "seed=-1" in message


def test_parameter_error_is_a_value_error() -> None:
    assert issubclass(ParameterError, ValueError)
    with pytest.raises(ValueError):
        parse_params(scale=3)


def test_direct_construction_still_validates() -> None:
    with pytest.raises(pydantic.ValidationError):
        UpscaleParams(scale=3)


def test_output_name_is_one_rule_with_or_without_the_timestamp() -> None:
    """The command's name (stamped: a rerun writes a new file) and the archive's (not: a rerun finds the output)."""
    from datetime import datetime

    from k6vsr_core.contract.params import output_name

    assert output_name("/clips/a.b.mov", parse_params(scale=2)) == "a.b_sr2x.mp4"
    assert output_name("clip.mp4", parse_params(scale=2.25, codec="ffv1")) == "clip_sr2.25x.mkv"
    stamped = output_name("clip.mp4", parse_params(scale=4), datetime(2026, 3, 1, 9, 5, 7))
    assert stamped == "clip_sr4x_20260301-090507.mp4"
