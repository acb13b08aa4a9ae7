"""`k6vsr preview`: representative windows upscaled into the run's own store, reused by the whole run; the files it
writes and the estimate it makes."""

from __future__ import annotations

import time
from pathlib import Path

import av
import numpy as np
import pytest
from media_kit import clip_frames
from PIL import Image

from entrypoints.cli import build_parser
from entrypoints.console import preview_lines
from k6vsr_core import UpscaleParams, media
from k6vsr_core.contract.plan import ModelTraits, make_plan, representative_windows
from k6vsr_core.media.encoding import VideoEncoding
from service.runs import ModelSpec, prepare_run
from storage import RunStore
from storage.estimate import StageRates, estimate_run, read_rates

SCENES = UpscaleParams(scale=2, windows="scenes")
IMPORTED_AT = time.time()


def test_representative_windows_spread_over_the_clip_or_one_per_shot() -> None:
    even = make_plan((64, 64), 1440, 24.0, UpscaleParams(scale=2), ModelTraits())
    assert even.num_windows == 14
    assert representative_windows(even, 3) == (0, 6, 13)
    assert representative_windows(even, 1) == (7,)
    assert representative_windows(even, 50) == tuple(range(14))
    shots = make_plan((64, 64), 700, 24.0, SCENES, ModelTraits(), cuts=(300, 500))
    firsts = [w.index for w in shots.windows if w.start in (0, 300, 500)]
    assert representative_windows(shots, 3) == tuple(firsts) and len(shots.windows) > 3
    with pytest.raises(ValueError, match="at least one window"):
        representative_windows(even, 0)


def test_the_estimate_adds_the_stages_up_by_their_units() -> None:
    plan = make_plan((64, 64), 250, 24.0, UpscaleParams(scale=2), ModelTraits())  # 3 windows of 121
    rates = StageRates(
        ingest_s=2.0, model_s_per_frame=0.1, segment_s_per_frame=0.01, encoded_bytes_per_frame=1000, windows_measured=1
    )
    estimate = estimate_run(plan, rates)
    assert estimate.seconds == pytest.approx(2.0 + 0.1 * 363 + 0.01 * 250, abs=0.05)
    assert estimate.output_bytes == 250_000 and estimate.seconds_left == estimate.seconds
    blended = {"blend": ["0", "2"]}
    assert estimate_run(plan, rates, blended).seconds_left == pytest.approx(estimate.seconds - 0.1 * 242, abs=0.1)
    # What the store holds is left out, whichever command asks: the ingest, a window by the share of its tiles
    # decoded (one tile here: all of window 1), the segments written.
    done = {"ingest": ["all"], "decode": ["1-0"], "blend": ["0"], "segment": ["0"]}
    start, stop = plan.segment_range(0)
    saved = 2.0 + 0.1 * 242 + 0.01 * (stop - start)
    assert estimate_run(plan, rates, done).seconds_left == pytest.approx(estimate.seconds - saved, abs=0.1)
    # What a process's first window costs beyond the rate is paid once, by the whole run and by what is left.
    first = estimate_run(plan, rates.model_copy(update={"first_window_extra_s": 30.0}), {"blend": ["0"]})
    assert first.seconds == pytest.approx(estimate.seconds + 30, abs=0.05)
    assert first.seconds_left == pytest.approx(first.seconds - 0.1 * 121, abs=0.1)
    # The command's head (imports, the server, the workers) is paid by every command that runs the clip.
    head = estimate_run(plan, rates.model_copy(update={"command_head_s": 20.0}), done)
    assert head.seconds == pytest.approx(estimate.seconds + 20, abs=0.05)
    assert head.seconds_left == pytest.approx(estimate_run(plan, rates, done).seconds_left + 20, abs=0.05)


def test_the_preview_runs_the_chosen_windows_as_a_run_schedules_them() -> None:
    """Only the chosen windows' model work and blends, with the run's own needs; the next chosen window is encoded
    once the one before it is being denoised, as a run encodes one window ahead; no segment (it needs neighbours)."""
    from flows.preview import preview_graph
    from runtime.schedule import Item, Scheduler

    plan = make_plan((64, 64), 250, 24.0, UpscaleParams(scale=2), ModelTraits())  # 3 windows of 121, 1 tile
    graph = preview_graph(plan, (0, 2))
    assert {(item.stage, item.window) for item in graph.items} == {
        (stage, window) for stage in ("encode", "denoise", "decode", "blend") for window in (0, 2)
    }
    encode = Item("encode", 2, tiles=(0,))
    assert graph.needs[encode] == () and graph.waits_for_start(encode) == (Item("denoise", 0, 0, (0,)),)
    assert graph.needs[Item("blend", 2)] == (Item("decode", 2, 0, (0,)),)
    # Through the scheduler, every item runs once, each after what it needs.
    import concurrent.futures

    ran: list[Item] = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:

        def submit(item: Item) -> concurrent.futures.Future:
            ran.append(item)
            return pool.submit(lambda: item)

        finished = [item for item, _ in Scheduler(graph, submit, submit, 2).run()]
    assert sorted(ran, key=str) == sorted(graph.items, key=str) == sorted(finished, key=str)
    assert finished.index(Item("blend", 0)) > finished.index(Item("decode", 0, 0, (0,)))
    # Where the run denoises and decodes a chunk as one task, so does its preview.
    fused = preview_graph(plan, (0, 2), fused=True)
    assert {(item.stage, item.window) for item in fused.items} == {
        (stage, window) for stage in ("encode", "denoise-decode", "blend") for window in (0, 2)
    }
    chunk = Item("denoise-decode", 0, 0, (0,))
    assert fused.waits_for_start(encode) == (chunk,) and fused.needs[Item("blend", 0)] == (chunk,)


def test_the_rate_is_the_previews_wall_clock_over_the_frames_it_computed() -> None:
    """Two windows computed side by side end together: the second's few seconds after the first are no rate (the
    preview of 2026-12-03 that took them for one estimated a 89 s run at 75 s); the wall clock over both is."""
    from flows.preview import model_rate

    assert model_rate([(121.0, 121)]) == 1.0  # one window: an upper bound
    assert model_rate([(70.3, 121), (1.5, 121)]) == pytest.approx(71.8 / 242)
    assert model_rate([(150.0, 121), (60.5, 121), (30.0, 57)]) == pytest.approx(240.5 / 299)


def test_the_pace_leaves_out_the_seconds_every_model_task_stood_compiling() -> None:
    """A cold compile took half of a one-window preview's window on an H100 (2026-12-06): the run after it, its
    cache warm, compiles nothing. Compiling while another task computes costs the run nothing (the GPU is busy)."""
    from flows.preview import ModelWork, compile_stall

    work = [
        ModelWork(start=0, end=10),  # the encode, no compile
        ModelWork(start=10, end=50, compiling=[(10, 45)]),  # the first denoise compiles the DiT
        ModelWork(start=12, end=46, compiling=[(12, 45)]),  # a second one waits for that compile
        ModelWork(start=50, end=60),
        ModelWork(start=55, end=100, compiling=[(55, 90)]),  # the first decode compiles beside a denoise
    ]
    # 10-45: both running tasks compile (35 s); 55-60: a denoise computes beside the compile; 60-90: only the
    # compile runs (30 s); 100-110 nothing runs (the blend's tail): kept.
    assert compile_stall(work, 0, 110) == pytest.approx(65)
    assert compile_stall(work, 20, 70) == pytest.approx(25 + 10)
    assert compile_stall(work[:1] + work[3:4], 0, 110) == 0
    assert compile_stall([], 0, 10) == 0


def test_the_commands_head_counts_from_its_process_start() -> None:
    """`k6vsr preview` hands its flow the process's start: the imports before any of its code ran count too."""
    from entrypoints.commands.preview import _command_started

    assert _command_started() < IMPORTED_AT <= time.time()


def test_the_preview_count_and_the_window_mode_are_two_flags() -> None:
    args = build_parser().parse_args(["preview", "in.mp4", "--windows", "2", "--window-mode", "scenes"])
    assert (args.preview_windows, args.windows) == (2, "scenes")
    assert build_parser().parse_args(["plan", "in.mp4", "--windows", "scenes"]).windows == "scenes"


@pytest.fixture(scope="module")
def three_shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three short shots (15 + 15 + 9 frames): three small windows under scene windows."""
    frames, _ = clip_frames([15, 15, 9])
    path = tmp_path_factory.mktemp("preview") / "three.mkv"
    media.write_video(path, frames, 24, None, encoding=VideoEncoding(codec="ffv1"))
    return path


def test_a_preview_is_reused_by_the_whole_run(
    prefect_server: str, tiny_bundle_path: Path, three_shots: Path, tmp_path: Path
) -> None:
    from flows.orchestrate import prefect_api, run_clip
    from flows.preview import preview_clip

    model = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    store = tmp_path / "store"
    prepared = prepare_run(three_shots, SCENES, model, store)
    assert prepared.plan.cuts == (15, 30) and prepared.plan.num_windows == 3
    with prefect_api():
        asked = time.time() - 7.0  # as if the command had begun 7 s before: its imports, the server
        state = preview_clip(
            prepared=prepared, model=model, count=2, out_dir=str(tmp_path), command_started=asked, return_state=True
        )
        preview = state.result()
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:  # named after the clip, as a clip run is
            assert client.read_flow_run(state.state_details.flow_run_id).name == "preview-three.mkv"
    assert preview.windows == [0, 2] and preview.frames == [(0, 15), (30, 39)]
    # The side-by-side holds the previewed frames, source and output side by side; the sheet a row per window.
    with av.open(preview.side_by_side) as container:
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(decoded) == 24 and decoded[0].shape == (128, 256, 3)
    assert np.asarray(Image.open(preview.contact_sheet)).shape == (256, 256, 3)
    # Measured rates, kept in the store, and an estimate from them.
    assert preview.rates is not None and preview.rates.windows_measured == 2 and preview.rates.model_s_per_frame > 0
    assert preview.rates.command_head_s >= 7.0  # paid again by the run's own command: in the estimate
    assert read_rates(RunStore(store, prepared.run.run_key)) == preview.rates
    estimate = preview.estimate
    assert estimate is not None and 0 < estimate.seconds_left < estimate.seconds
    # `k6vsr plan` says the same time left as the preview did: one estimator, the store's work left out.
    from entrypoints.commands.plan import _run_estimate

    assert _run_estimate(prepare_run(three_shots, SCENES, model, store)) == estimate.model_dump()
    assert "whole run     about" in preview_lines(preview.model_dump(mode="json"))[-1]
    # The whole run computes only the window the preview did not.
    summary = run_clip(prepare_run(three_shots, SCENES, model, store), str(tmp_path / "out.mp4"), model).summary()
    assert (summary.tiles_computed, summary.tiles_reused) == (1, 2)
    assert summary.quality is not None and summary.quality.frames == 39
