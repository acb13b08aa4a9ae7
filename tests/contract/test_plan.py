"""Tests for k6vsr_core.contract.plan: grid, per-chunk seeds, step counts and delivery sizes of one clip (contract
§B-§F)."""

from __future__ import annotations

import warnings

import pytest

from k6vsr_core.contract.params import parse_params
from k6vsr_core.contract.plan import ModelTraits, make_plan

FLOW = ModelTraits(scheduler="FlowMatchEulerDiscreteScheduler", trained_steps=4)


def test_plan_512x768_x2_has_nine_tiles() -> None:
    plan = make_plan((512, 768), 121, 24, parse_params(scale=2))
    assert plan.num_tiles == 9
    assert plan.grid.tops == (0, 128, 256)
    assert plan.grid.lefts == (0, 192, 384)
    assert plan.latent_frames == 31
    assert plan.sr_size == (1024, 1536)
    assert plan.delivery_size == (1024, 1536)
    assert plan.steps == 2
    assert plan.fps == 24


@pytest.mark.parametrize(
    ("batch", "tiles", "seeds"),
    [
        (1, [(i,) for i in range(9)], [42 + i for i in range(9)]),
        (2, [(0, 1), (2, 3), (4, 5), (6, 7), (8,)], [42, 44, 46, 48, 50]),
        (4, [(0, 1, 2, 3), (4, 5, 6, 7), (8,)], [42, 46, 50]),
        (16, [tuple(range(9))], [42]),
    ],
)
def test_chunk_seed_is_seed_plus_first_tile(batch: int, tiles: list[tuple[int, ...]], seeds: list[int]) -> None:
    plan = make_plan((512, 768), 9, 24, parse_params(scale=2, tiles_batch_size=batch))
    assert [chunk.tiles for chunk in plan.chunks] == tiles
    assert [chunk.seed for chunk in plan.chunks] == seeds
    assert [chunk.index for chunk in plan.chunks] == list(range(len(tiles)))


def test_chunk_seed_follows_request_seed() -> None:
    plan = make_plan((512, 768), 9, 24, parse_params(scale=2, seed=1000, tiles_batch_size=4))
    assert [chunk.seed for chunk in plan.chunks] == [1000, 1004, 1008]
    assert plan.chunk_of(6).seed == 1004
    assert plan.chunk_of(8).tiles == (8,)


def test_piflow_runs_trained_steps_and_warns() -> None:
    with pytest.warns(UserWarning, match="num_inference_steps=5 is ignored"):
        plan = make_plan((512, 768), 9, 24, parse_params(scale=2, num_inference_steps=5))
    assert plan.steps == 2


def test_piflow_default_and_matching_request_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_plan((512, 768), 9, 24, parse_params(scale=2)).steps == 2
        assert make_plan((512, 768), 9, 24, parse_params(scale=2, num_inference_steps=2)).steps == 2


def test_piflow_trained_steps_come_from_traits() -> None:
    traits = ModelTraits(trained_steps=3)
    assert make_plan((512, 768), 9, 24, parse_params(scale=2), traits).steps == 3


def test_flow_euler_default_and_requested_steps() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_plan((512, 768), 9, 24, parse_params(scale=2), FLOW).steps == 4
        assert make_plan((512, 768), 9, 24, parse_params(scale=2, num_inference_steps=7), FLOW).steps == 7


def test_x225_plans_on_the_pre_upscaled_size() -> None:
    plan = make_plan((480, 864), 9, 24, parse_params(scale=2.25))
    assert plan.source_size == (480, 864)
    assert plan.grid.source_size == (544, 976)
    assert plan.grid.tiling_scale == 2
    assert plan.sr_size == (1088, 1952)


def test_x4_plan() -> None:
    plan = make_plan((480, 864), 9, 24, parse_params(scale=4))
    assert (len(plan.grid.tops), len(plan.grid.lefts)) == (5, 6)
    assert plan.grid.tile == (128, 192)
    assert plan.sr_size == (1920, 3456)


def test_delivery_size_with_tier() -> None:
    plan = make_plan((512, 768), 9, 24, parse_params(scale=2, target_resolution="hd"))
    assert plan.sr_size == (1024, 1536)
    assert plan.delivery_size == (720, 1080)
    exact = make_plan((512, 768), 9, 24, parse_params(scale=2, target_resolution="768x512", target_resize_mode="exact"))
    assert exact.delivery_size == (512, 768)


def test_delivery_size_kept_when_tier_is_larger() -> None:
    with pytest.warns(UserWarning):
        plan = make_plan((512, 768), 9, 24, parse_params(scale=2, target_resolution="fullhd"))
    assert plan.delivery_size == plan.sr_size == (1024, 1536)


def test_padded_source_plan() -> None:
    plan = make_plan((161, 257), 1, 24, parse_params(scale=2))
    assert plan.grid.padded_size == (256, 384)
    assert plan.sr_size == (322, 514)
    assert plan.latent_frames == 1
    assert plan.num_tiles == 1


@pytest.mark.parametrize("frames", [2, 8, 10, 120])
def test_every_frame_is_kept_in_a_window_padded_to_1_plus_8k(frames: int) -> None:
    plan = make_plan((512, 768), frames, 24, parse_params(scale=2))
    assert plan.num_frames == frames and plan.num_windows == 1
    assert (
        plan.window_frames == 1 + 8 * -(-(frames - 1) // 8) and plan.latent_frames == 1 + (plan.window_frames - 1) // 4
    )


@pytest.mark.parametrize("frames", [2, 8, 10, 120, 300])
def test_contract_mode_keeps_the_first_121_floored_to_1_plus_8k(frames: int) -> None:
    plan = make_plan((512, 768), frames, 24, parse_params(scale=2, frames="contract"))
    assert plan.num_frames == min(121, 1 + 8 * ((frames - 1) // 8)) == plan.window_frames and plan.num_windows == 1


def test_a_source_without_frames_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one frame"):
        make_plan((512, 768), 0, 24, parse_params(scale=2))


def test_tiny_tile_traits() -> None:
    traits = ModelTraits(tile_sizes=((128, 128), (128, 256), (256, 128)))
    plan = make_plan((64, 96), 1, 24, parse_params(scale=2), traits)
    assert plan.grid.base == (128, 128)
    assert plan.grid.lefts == (0, 32)
    assert plan.sr_size == (128, 192)
