"""The run's progress display: the bar counts every (window, tile) item of the run, not one window's, and names the
stage and window holding the run back, from the store's records alone."""

from __future__ import annotations

from pathlib import Path

from entrypoints.progress import clips_text, describe, run_stage
from k6vsr_core.bundle import TINY_TILE_SIZES
from k6vsr_core.params import parse_params
from k6vsr_core.plan import ModelTraits, make_plan
from storage import RunStore

# 250 frames at 24 fps: three windows of the tiny model's 6 tiles each (128x96 at x2).
PLAN = make_plan((96, 128), 250, 24.0, parse_params(scale="2"), ModelTraits(tile_sizes=TINY_TILE_SIZES))


def _record(store: RunStore, stage: str, *items: str) -> None:
    folder = store.path / "done" / stage
    folder.mkdir(parents=True, exist_ok=True)
    for item in items:
        (folder / f"{item}.json").write_text("{}")


def test_stages_and_windows_as_the_run_passes(tmp_path: Path) -> None:
    assert (PLAN.num_windows, PLAN.num_tiles) == (3, 6)
    store = RunStore(tmp_path, "run")
    assert run_stage(store, PLAN) == ("ingest", 0)
    _record(store, "ingest", "audio", "all")
    assert run_stage(store, PLAN) == ("encode", 0)
    _record(store, "encode", "0", "1")
    assert run_stage(store, PLAN) == ("denoise", 0)
    _record(store, "denoise", *(f"0-{tile}" for tile in range(6)))
    assert run_stage(store, PLAN) == ("decode", 0)
    _record(store, "decode", *(f"0-{tile}" for tile in range(6)))
    assert run_stage(store, PLAN) == ("denoise", 1)  # window 1 is encoded already
    assert describe(*run_stage(store, PLAN), PLAN) == "denoise, window 2 of 3"
    assert store.tiles_decoded() == 6  # of 18: the bar's total is every window's tiles
    _record(store, "decode", *(f"{window}-{tile}" for window in (1, 2) for tile in range(6)))
    assert run_stage(store, PLAN) == ("blend and segment", 2)
    _record(store, "segment", "0", "1", "2")
    assert run_stage(store, PLAN) == ("mux", 2)


def test_an_archive_counts_its_clips_done_failed_and_left() -> None:
    statuses = ["done", "failed", "planned", "planned", "skipped", "reused"]
    assert clips_text(statuses) == ("clips: 1 done, 1 failed, 2 left", 2, 4)
