"""The run's progress displays: the bar counts every (window, tile) item of the run, not one window's, names the stage
and window holding the run back, from the store's records alone, and says the time left; an archive shows its clips
done, failed and left with the current clip's bar. The terminal and the Prefect UI say the same words."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
import timelines

from entrypoints import progress_bars as terminal
from k6vsr_core.contract.params import parse_params
from k6vsr_core.contract.plan import ModelTraits, make_plan
from k6vsr_core.model.tiny_bundle import TINY_TILE_SIZES
from storage import RunStore
from storage.progress import ProgressCounter, RunProgress, read_progress, run_finished, stage_counts
from storage.records import CompletionRecord
from storage.time_left import ClipTime, Span, _slots_free, archive_seconds_left, seconds_left, window_items

# 250 frames at 24 fps: three windows of the tiny model's 6 tiles each (128x96 at x2).
PLAN = make_plan((96, 128), 250, 24.0, parse_params(scale="2"), ModelTraits(tile_sizes=TINY_TILE_SIZES))


def _record(store: RunStore, stage: str, *items: str) -> None:
    folder = store.path / "done" / stage
    folder.mkdir(parents=True, exist_ok=True)
    for item in items:
        (folder / f"{item}.json").write_text("{}")


def _tiles(window: int, count: int = 6) -> list[str]:
    return [f"{window}-{tile}" for tile in range(count)]


def test_stages_and_windows_as_the_run_passes(tmp_path: Path, monkeypatch) -> None:
    assert (PLAN.num_windows, PLAN.num_tiles) == (3, 6)
    store = RunStore(tmp_path, "run")

    def now() -> str:
        return read_progress(store, PLAN).text()

    assert now() == "ingest · window 1 of 3 · 0 of 18 tiles"
    _record(store, "ingest", "audio", "all")
    assert now() == "encode · window 1 of 3 · 0 of 18 tiles"
    _record(store, "encode", "0", "1")
    assert now() == "denoise · window 1 of 3 · 0 of 18 tiles"
    _record(store, "denoise", *_tiles(0))
    assert now() == "decode · window 1 of 3 · 0 of 18 tiles"
    _record(store, "decode", *_tiles(0, 4))
    assert now() == "decode · window 1 of 3 · 4 of 18 tiles"
    _record(store, "decode", *_tiles(0))
    assert now() == "denoise · window 2 of 3 · 6 of 18 tiles"  # window 2 is encoded already
    _record(store, "denoise", *_tiles(1))
    _record(store, "decode", *_tiles(1, 1))
    assert now() == "decode · window 2 of 3 · 7 of 18 tiles"
    _record(store, "decode", *_tiles(1))
    assert now() == "encode · window 3 of 3 · 12 of 18 tiles"
    _record(store, "encode", "2")
    _record(store, "denoise", *_tiles(2))
    _record(store, "decode", *_tiles(2))
    _record(store, "blend", "0")
    assert now() == "blend · window 2 of 3 · 18 of 18 tiles"
    _record(store, "blend", "1", "2")
    _record(store, "segment", "0", "1")
    assert now() == "segment · window 3 of 3 · 18 of 18 tiles"
    _record(store, "segment", "2")
    assert now() == "mux · window 3 of 3 · 18 of 18 tiles"
    # The joined output recorded (its record carries the file's checksum, which this test does not write).
    monkeypatch.setattr(RunStore, "output_done", lambda self: True)
    assert now() == "publish · window 3 of 3 · 18 of 18 tiles"
    assert run_finished(PLAN).text() == "done · 18 of 18 tiles"


def test_the_flows_counter_says_what_the_records_say_without_listing_them(tmp_path: Path, monkeypatch) -> None:
    store = RunStore(tmp_path, "run")
    _record(store, "ingest", "all")
    _record(store, "encode", "0")
    counter = ProgressCounter(store, PLAN)
    assert counter.progress() == read_progress(store, PLAN)
    finishes = [
        ("denoise", 0, tuple(range(6))),
        ("decode", 0, (0, 1, 2, 3)),
        ("encode", 1, ()),
        ("decode", 0, (4, 5)),
        ("denoise", 1, (0, 1, 2)),
        ("encode", 2, ()),
        ("denoise", 1, (3, 4, 5)),
        *[("decode", 1, (tile,)) for tile in range(6)],
        ("denoise", 2, tuple(range(6))),
        *[("decode", 2, (tile,)) for tile in range(6)],
        *[(stage, window, ()) for stage in ("blend", "segment") for window in range(3)],
    ]
    expected = []
    for stage, window, tiles in finishes:
        if tiles:
            _record(store, stage, *(f"{window}-{tile}" for tile in tiles))
        else:
            _record(store, stage, str(window))
        expected.append(read_progress(store, PLAN).text())
    monkeypatch.setattr(store.records, "items", lambda stage: pytest.fail(f"listed the {stage} records"))
    seen = []
    for stage, window, tiles in finishes:
        counter.finished(stage, window, tiles)
        seen.append(counter.progress().text())
    assert seen == expected and seen[-1] == "mux · window 3 of 3 · 18 of 18 tiles"
    counter.finished("mux", 2)
    assert counter.progress().text() == "publish · window 3 of 3 · 18 of 18 tiles"


def test_the_stage_named_is_the_one_the_windows_time_goes_to(tmp_path: Path) -> None:
    """Window 1 with 4 tiles denoised and 2 decoded: 2 denoises and 4 decodes left. By count the denoise comes
    first; at 6 s a denoise and 100 s a decode, the decodes hold the window back, and the bar says so."""
    store = RunStore(tmp_path, "run")
    _record(store, "ingest", "all")
    _record(store, "encode", "0")
    _record(store, "denoise", *_tiles(0, 4))
    _record(store, "decode", *_tiles(0, 2))
    assert read_progress(store, PLAN).stage == "denoise"  # nothing timed: the stage that comes first
    assert read_progress(store, PLAN, {"denoise": 6.0, "decode": 100.0}).stage == "decode"
    assert read_progress(store, PLAN, {"denoise": 100.0, "decode": 6.0}).stage == "denoise"
    counter = ProgressCounter(store, PLAN)
    counter.finished("denoise", 0, (3,), seconds=6.0)
    counter.finished("decode", 0, (1,), seconds=100.0)
    assert counter.progress().text() == "decode · window 1 of 3 · 2 of 18 tiles"


def test_one_window_names_no_window() -> None:
    assert RunProgress("decode", 0, 1, 2, 6).text() == "decode · 2 of 6 tiles"
    assert RunProgress("decode", 0, 1, 0, 1).text() == "decode · 0 of 1 tile"


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _timed(store: RunStore, stage: str, item: str, start: float, end: float) -> None:
    """A record of an item this run computed between `start` and `end`."""
    folder = store.path / "done" / stage
    folder.mkdir(parents=True, exist_ok=True)
    record = CompletionRecord(stage=stage, item=item, checksum="x", seconds=end - start, written_at=end, attempt="a")
    (folder / f"{item}.json").write_text(record.model_dump_json())


def test_the_terminal_bar_says_the_artifact_words_and_the_time_left(tmp_path: Path, monkeypatch) -> None:
    clock = FakeTime()
    monkeypatch.setattr("tqdm.std.time", clock)
    store = RunStore(tmp_path, "run")
    _record(store, "ingest", "all")  # found done: they say nothing of this run's pace
    _record(store, "encode", "0", "1")
    _record(store, "denoise", *_tiles(0), *_tiles(1))
    _record(store, "decode", *_tiles(0))
    out = io.StringIO()
    clock.now = 1000.0
    bar = terminal.RunBar(store, PLAN, out, clock=clock)
    clock.now = 1010.0
    bar.show()
    assert out.getvalue().split("\r")[-1].endswith("| 00:10 elapsed, ? left")  # no decode timed by this run yet
    for start, stage, item in [(1000, "decode", "1-0"), (1000, "decode", "1-1"), (1010, "encode", "2")]:
        _timed(store, stage, item, start, start + 10.0)
    for start, stage, item in [(1010, "decode", "1-2"), (1020, "denoise", "2-0"), (1020, "decode", "1-3")]:
        _timed(store, stage, item, start, start + 10.0)
    clock.now = 1030.0
    bar.show()
    shown = out.getvalue().split("\r")[-1]
    assert shown.startswith("decode · window 2 of 3 · 10 of 18 tiles |"), shown
    # Items of 10 s, each beside another: window 2's decodes two by two, then window 3's denoises beside its
    # decodes, 6 steps of 10 s; its last decode alone, with the device to itself, 5 s (blend, segment, mux unmeasured).
    assert shown.endswith("| 00:30 elapsed, 01:05 left"), shown
    clock.now = 1040.0  # no item ended: the estimate counts down, redrawn with the elapsed time
    bar.show()
    assert out.getvalue().split("\r")[-1].endswith("| 00:40 elapsed, 00:55 left")
    bar.close()


def _done(*spans: Span, **found: list[str]) -> dict[str, set[str]]:
    """The items recorded done: those of `spans`, and those `found` done (by stage) before the run."""
    done: dict[str, set[str]] = {stage: set(items) for stage, items in found.items()}
    for span in spans:
        done.setdefault(span.stage, set()).add(span.item)
    return done


def _window_spans(window: int, start: float, pace: float = 10.0) -> list[Span]:
    """A window of `PLAN` computed on a lane of two from `start`: its encode, then its tiles two by two, each
    chunk denoised and then its tile decoded, each item `pace` seconds; its blend streamed (from its first decode)."""
    spans = [Span("encode", start, start + pace, str(window))]
    for pair in range(3):
        at = start + pace + 2 * pace * pair
        for tile in (2 * pair, 2 * pair + 1):
            spans += [Span("denoise", at, at + pace, f"{window}-{tile}")]
            spans += [Span("decode", at + pace, at + 2 * pace, f"{window}-{tile}")]
    last = start + 7 * pace
    spans += [Span("blend", start + 3 * pace, last + 2, str(window)), Span("segment", last + 2, last + 5, str(window))]
    return spans


def test_time_left_is_the_lane_replayed_forward_at_this_runs_pace() -> None:
    encode = Span("encode", 0.0, 30.0, "0")
    assert seconds_left(PLAN, _done(encode), [encode], 40.0, 0.0) is None  # neither denoise nor decode timed
    first = _window_spans(0, 0.0)
    # Window 0 computed (70 s), its blend 2 s after its last decode and its segment 3 s: windows 1 and 2 take 70 s
    # each on the lane, one after the other, then the last window's blend and segment; no mux timed yet.
    assert seconds_left(PLAN, _done(*first), first, 75.0, 0.0) == pytest.approx(140.0 + 2 + 3 - 5)
    # Counted down between records, never below what is in flight: window 1's encode, started as a slot freed at
    # 70 s, ends at 80 s at the soonest. Still running at 100 s, it has taken 30 s: the machine is slower now, and
    # window 2's encode counts at 20 s, the mean of window 0's 10 s and that 30 s.
    assert seconds_left(PLAN, _done(*first), first, 80.0, 0.0) == pytest.approx(140.0 + 2 + 3 - 10)
    assert seconds_left(PLAN, _done(*first), first, 100.0, 0.0) == pytest.approx(140.0 + 2 + 3 - 10 + 10)
    # One tile left, its decode in flight since its denoise ended at 130 s: what is left is that decode's rest and
    # the tail, not a whole decode over the lane's width nor the blend's record, which spans its wait for decodes.
    every = [*first, *_window_spans(1, 70.0), *[span for span in _window_spans(2, 140.0) if span.item != "2-5"][:-2]]
    every.append(Span("denoise", 190.0, 200.0, "2-5"))
    assert seconds_left(PLAN, _done(*every), every, 205.0, 0.0) == pytest.approx(5 + 2 + 3)
    mux = Span("mux", 215.0, 216.0, "all")
    assert seconds_left(PLAN, _done(*every, mux, blend=["2"], segment=["2"]), [*every, mux], 216.0, 0.0) == 0.0
    # The latest window's pace: items got faster (the machine's load went down) in window 1, 5 s each, so window 2
    # takes 35 s from 105 s, then its blend's 2 s and its segment's 3 s.
    faster = [*first, *_window_spans(1, 70.0, pace=5.0)]
    assert seconds_left(PLAN, _done(*faster), faster, 110.0, 0.0) == pytest.approx(105.0 + 35 + 2 + 3 - 110)
    assert window_items(PLAN) == {
        "ingest": 1,
        "encode": 1,
        "denoise": 6,
        "decode": 6,
        "blend": 1,
        "segment": 1,
        "mux": 1,
    }


def test_a_resumed_run_counts_its_earlier_attempts_timings_and_none_of_their_items_as_its_work() -> None:
    """Killed after window 0 and started again at 1000 s: the first attempt's timeline stands in for the paces this
    run has not timed, so a figure shows at once; window 0, found done, takes no slot and no time."""
    earlier = _window_spans(0, 0.0)
    done = _done(*earlier)
    assert seconds_left(PLAN, done, [], 1000.0, 1000.0, earlier) == pytest.approx(140.0 + 2 + 3)
    assert seconds_left(PLAN, done, [], 1000.0, 1000.0) is None  # nothing timed at all
    # Its own first items, at its own pace, then count: its decodes take 20 s here, not 10.
    own = [
        Span("encode", 1000.0, 1010.0, "1"),
        Span("denoise", 1010.0, 1020.0, "1-0"),
        Span("denoise", 1010.0, 1020.0, "1-1"),
    ]
    own += [Span("decode", 1020.0, 1040.0, "1-0"), Span("decode", 1020.0, 1040.0, "1-1")]
    left = seconds_left(PLAN, _done(*earlier, *own), own, 1040.0, 1000.0, earlier)
    assert left is not None and left > 140.0 + 2 + 3 - 40


def test_a_previews_bar_moves_with_no_time_left(tmp_path: Path, monkeypatch) -> None:
    """`k6vsr preview` computes a few windows, not the plan's items left: its bar says where it stands and the time
    elapsed, every second from the model's load on, and no time left."""
    clock = FakeTime()
    monkeypatch.setattr("tqdm.std.time", clock)
    store = RunStore(tmp_path, "run")
    _record(store, "ingest", "all")
    out = io.StringIO()
    bar = terminal.RunBar(store, PLAN, out, clock=clock, time_left=False)
    for second in (1.0, 2.0):
        clock.now = second
        bar.show()
        assert out.getvalue().split("\r")[-1].endswith(f"| 00:0{second:.0f} elapsed"), out.getvalue()
    bar.close()


def _manifest(path: Path, store_root: Path, statuses: list[str]) -> None:
    rows = [
        {"relative_path": f"clip{i}.mp4", "run_key": f"run{i}", "status": status} for i, status in enumerate(statuses)
    ]
    path.write_text(json.dumps({"store_root": str(store_root), "rows": rows}))


def test_an_archive_shows_its_clips_and_the_current_clips_bar(tmp_path: Path, monkeypatch) -> None:
    manifest, root = tmp_path / "manifest.json", tmp_path / "store"
    out = io.StringIO()
    bars = terminal.ArchiveBars(manifest, out, since=time.time() - 60)
    bars.show()  # no manifest yet: planning
    assert bars.clips.desc == "planning the clips" and bars.bars == {}

    _manifest(manifest, root, ["done", "failed", "planned", "planned", "skipped", "reused"])
    bars.show()  # clip2 runs; its ingest has not recorded its plan yet
    assert bars.clips.desc == "clips: 1 done, 1 failed, 2 left · clip2.mp4: ingest" and bars.bars == {}

    store = RunStore(root, "run2")
    store.path.mkdir(parents=True)
    (store.path / "manifest.json").write_text("{}")  # not yet a readable manifest: still nothing to show
    bars.show()
    assert bars.bars == {}

    # Its ingest recorded the plan (a whole run manifest, which this test does not write).
    monkeypatch.setattr(terminal, "stored_plan", lambda store: PLAN if store.run_key == "run2" else None)
    _record(store, "ingest", "all")
    _record(store, "encode", "0")
    bars.show()
    assert bars.clips.desc == "clips: 1 done, 1 failed, 2 left"
    assert bars.bars["clip2.mp4"].bar.desc == "clip2.mp4: denoise · window 1 of 3 · 0 of 18 tiles"
    assert not bars.bars["clip2.mp4"].shared  # one clip at a time: its records show all the device does
    assert (bars.clips.n, bars.clips.total) == (2, 4)

    _manifest(manifest, root, ["done", "failed", "done", "planned", "skipped", "reused"])
    bars.show()  # clip2 ended; clip3 has no plan yet
    assert bars.bars == {} and bars.clips.desc == "clips: 2 done, 1 failed, 1 left · clip3.mp4: ingest"
    bars.close()


def _last_line(out: io.StringIO, start: str) -> str:
    """The line that starts with `start` as the terminal shows it last (without the cursor's moves)."""
    return next(line for line in out.getvalue().split("\r")[::-1] if line.startswith(start)).split("\x1b")[0]


def test_an_archives_time_left_counts_the_clips_still_to_run(tmp_path: Path, monkeypatch) -> None:
    """The clips' line says the archive's time left: the running clip's figure, and the clips still to run at the
    seconds an item of it took (elapsed and left over its items), not the running clip's alone."""
    clock = FakeTime()
    monkeypatch.setattr("tqdm.std.time", clock)
    monkeypatch.setattr(terminal, "stored_plan", lambda store: PLAN if store.run_key == "run0" else None)
    manifest, root = tmp_path / "manifest.json", tmp_path / "store"
    store = RunStore(root, "run0")
    _record(store, "ingest", "all")
    _record(store, "encode", "0", "1")
    _record(store, "denoise", *_tiles(0), *_tiles(1))
    _record(store, "decode", *_tiles(0))
    rows = [{"relative_path": f"clip{i}.mp4", "run_key": f"run{i}", "status": "planned", "tiles": 18} for i in (0, 1)]
    # The same source as a clip done before: its run's items are done, nothing to count.
    rows.insert(0, {"relative_path": "same.mp4", "run_key": "run9", "status": "done", "tiles": 18})
    rows.append({"relative_path": "same-again.mp4", "run_key": "run9", "status": "planned", "tiles": 18})
    manifest.write_text(json.dumps({"store_root": str(root), "rows": rows}))
    out = io.StringIO()
    clock.now = 1000.0
    bars = terminal.ArchiveBars(manifest, out, since=time.time() - 60, clock=clock)
    bars.show()
    assert _last_line(out, "clips:").endswith(", ? left")  # neither clip has a figure yet
    # As in the clip bar's test above: at 1030 s, 01:05 left of its 12 items, 4 computed.
    for start, stage, item in [(1000, "decode", "1-0"), (1000, "decode", "1-1"), (1010, "encode", "2")]:
        _timed(store, stage, item, start, start + 10.0)
    for start, stage, item in [(1010, "decode", "1-2"), (1020, "denoise", "2-0"), (1020, "decode", "1-3")]:
        _timed(store, stage, item, start, start + 10.0)
    clock.now = 1030.0
    bars.show()
    # What the archive counts of it: 30 s since its bar began, 65 s left, 12 items to compute (6 were found done),
    # 4 of them done.
    assert bars.bars["clip0.mp4"].timing() == ClipTime(30.0, pytest.approx(65.0), 12, 4)
    clips_line = _last_line(out, "clips:")
    assert clips_line.startswith("clips: 1 done, 0 failed, 3 left |"), clips_line
    assert clips_line.endswith(f", {terminal.left_text(65.0 + 18 * (30.0 + 65.0) / 12)}"), clips_line
    # clip0 failed at 1040 s with 4 items computed: clip1, its plan not recorded yet, counts at 10 s an item.
    rows[1]["status"] = "failed"
    manifest.write_text(json.dumps({"store_root": str(root), "rows": rows}))
    clock.now = 1040.0
    bars.show()
    assert bars.ended == [ClipTime(40.0, 0.0, 4, 4)]
    assert _last_line(out, "clips:").endswith(f", {terminal.left_text(18 * 10.0)}")
    bars.close()


def test_an_archives_time_left_goes_on_from_one_clip_to_the_next() -> None:
    """An archive of two runs of the recorded 250-frame clip, one after the other: the figure counts the second
    clip's items at the first's pace, so it does not drop to the first clip's 00:12 and then jump as the second
    starts (the second clip's own first records, its first decodes fast, are drawn toward that pace). Within the
    bounds from 202 s (as a lone clip's) to the end."""
    clips = timelines.one_after_another([timelines.streamed(_lines(CLIP250))] * 2)
    replayed = timelines.replay_archive([(PLAN, lines) for lines in clips])
    assert _misses(replayed, since=SLOWER_SEEN) == []


# Recorded 2026-12-06: `k6vsr archive --max-parallel 1` of two 64x64 clips (a.mp4, 250 frames; b.mp4, 241 frames;
# three windows of one tile each) with the tiny model on the shared two-core host (load average 12 to 14); each line
# names its clip, its times from the first clip's ingest.
ARCHIVE2 = Path(__file__).parents[1] / "data" / "archive2-timeline.jsonl"


def test_a_recorded_archives_time_left_holds_its_bounds_across_its_clips() -> None:
    """b.mp4's own first figure came with its first decode, 247 s into its 355 s: before it, the clip's bar said
    `? left` and nothing counted b.mp4 while a.mp4 ran. The archive's figure, from a.mp4's first decode on (its
    window 0 and 1 decodes ran side by side), counts b.mp4 at a.mp4's pace, within the bounds to the end."""
    lines = _lines(ARCHIVE2)
    plans = {
        "a.mp4": PLAN64,
        "b.mp4": make_plan((64, 64), 241, 24.0, parse_params(scale="2"), ModelTraits(tile_sizes=TINY_TILE_SIZES)),
    }
    clips = [(plan, [line for line in lines if line["clip"] == clip]) for clip, plan in plans.items()]
    assert [plan.num_windows * plan.num_tiles for plan, _ in clips] == [3, 3]
    replayed = timelines.replay_archive(clips)
    first = next(at for at, _, estimate in replayed if estimate is not None)
    first_decode = min(line["end"] for line in lines if line["stage"] == "decode")
    assert first == pytest.approx(first_decode, abs=1.0)
    assert _misses(replayed, since=first) == []


def test_an_archives_time_left_is_the_clips_figures_and_the_waiting_items_at_their_pace() -> None:
    assert archive_seconds_left([], [18]) is None
    assert archive_seconds_left([ClipTime(30.0, None, 12)], [18]) is None  # no clip has a figure
    # One clip ran: 100 s for 10 items; one running with 40 s left, 5 of 10 done (its own figure, drawn a quarter
    # toward 10 s an item: 50 s left at that pace); 20 items to go.
    ran, running = ClipTime(100.0, 0.0, 10, 10), ClipTime(50.0, 40.0, 10, 5)
    assert archive_seconds_left([ran, running], [20]) == pytest.approx(0.25 * 50 + 0.75 * 40 + 200)
    # Two at once: the work split between them, never less than the longest running.
    assert archive_seconds_left([ran, running], [20], parallel=2) == pytest.approx((0.25 * 50 + 0.75 * 40 + 200) / 2)
    assert archive_seconds_left([ran, ClipTime(50.0, 400.0, 10, 9)], [], parallel=2) == pytest.approx(
        0.01 * 50 + 0.99 * 400
    )


def test_an_archive_shows_a_bar_for_each_clip_it_runs_at_once(tmp_path: Path, monkeypatch) -> None:
    """`--max-parallel 2`: the first two clips still planned run, each on a line of its own."""
    manifest, root = tmp_path / "manifest.json", tmp_path / "store"
    monkeypatch.setattr(terminal, "stored_plan", lambda store: PLAN)
    for key in ("run1", "run2", "run3"):
        _record(RunStore(root, key), "ingest", "all")
    out = io.StringIO()
    bars = terminal.ArchiveBars(manifest, out, since=time.time() - 60, parallel=2)
    _manifest(manifest, root, ["done", "planned", "planned", "planned"])
    bars.show()
    assert {path: bar.position for path, bar in bars.bars.items()} == {"clip1.mp4": 1, "clip2.mp4": 2}
    assert all(bar.shared for bar in bars.bars.values())  # each clip's items share the queue with the other's
    assert bars.clips.desc == "clips: 1 done, 0 failed, 3 left"
    lines = out.getvalue()
    assert "clip1.mp4: encode · window 1 of 3 · 0 of 18 tiles |" in lines and "clip2.mp4: encode" in lines

    _manifest(manifest, root, ["done", "done", "planned", "planned"])
    bars.show()  # clip1 ended: clip3 takes its line
    assert {path: bar.position for path, bar in bars.bars.items()} == {"clip2.mp4": 2, "clip3.mp4": 1}
    assert "clip3.mp4: encode" in out.getvalue()
    bars.close()


def test_an_old_manifest_is_a_previous_runs_and_not_read(tmp_path: Path) -> None:
    manifest = tmp_path / "manifest.json"
    _manifest(manifest, tmp_path, ["done", "planned"])
    bars = terminal.ArchiveBars(manifest, io.StringIO(), since=time.time() + 60)
    bars.show()
    assert bars.clips.desc == "planning the clips"
    bars.close()


def test_stage_counts_come_from_the_timeline_of_the_attempt(tmp_path: Path) -> None:
    """What an attempt computed is what its timeline says, each item once; the rest of each stage it reused."""
    store = RunStore(tmp_path, "run")
    records = store.records
    for stage, items in (("ingest", ["all"]), ("encode", ["0", "1", "2"]), ("decode", _tiles(0))):
        for item in items:
            records.write(stage, item, "sum", seconds=1.0, attempt="first")
    records.write("decode", "1-0", "sum", seconds=1.0, attempt="second")
    records.write("decode", "1-1", "sum", seconds=1.0, attempt="second")
    records.write("decode", "1-1", "sum", seconds=1.0, attempt="second")  # a retry computed it again
    records.write("decode", "1-2", "sum", seconds=0.0, attempt="second")  # found done: no line
    with open(store.path / "timeline.jsonl", "a") as log:
        log.write('{"stage": "decode", "item": "1-')  # a line cut short by a killed process
    counts = stage_counts(store, PLAN, "second")
    assert counts["decode"].text() == "2 computed, 16 reused"
    assert counts["ingest"].text() == "0 computed, 1 reused"
    assert stage_counts(store, PLAN, "first")["encode"].text() == "3 computed, 0 reused"
    assert list(counts) == ["ingest", "encode", "denoise", "decode", "blend", "segment", "mux"]


CLIP250 = Path(__file__).parents[1] / "data" / "clip250-timeline.jsonl"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _misses(replayed: list[tuple], since: float = 0.0) -> list[tuple]:
    """The instants from `since` on where the estimate is missing or off by more than the issue allows: 20 % while
    two minutes or more are left, 20 s in the last two."""
    return [
        (round(at), round(actual), estimate if estimate is None else round(estimate))
        for at, actual, estimate in replayed
        if at >= since and (estimate is None or abs(estimate - actual) > (0.2 * actual if actual >= 120 else 20.0))
    ]


SLOWER_SEEN = 202.0  # when the replay of `CLIP250` is back within the bounds after its decodes slowed


def test_time_left_through_a_whole_run_is_within_a_fifth_and_within_20_s_at_the_end() -> None:
    """The timeline of a real run of the 250-frame clip (tiny model, on the CPU of a shared two-core machine,
    2026-12-03; 1053 s): three windows of 6 tiles, as `PLAN`; its blends streamed, as a run does now, their lines
    spanning their wait for the decodes (what made the tail 2 to 4 minutes too long). Replayed second by second.

    From the first chunk's decodes on (88 s) there is a figure; those two decodes took 66 s and every later one 86
    to 122 s (the host's load rose), which no estimate made at 88 s can know, 35 to 40 % low until the next two
    have run past 66 s (161 s). From there those two, still running, count at what they have taken so far: the
    bounds hold from 202 s on, not only from their end (212 s)."""
    replayed = timelines.replay(PLAN, timelines.streamed(_lines(CLIP250)), 0.0)
    assert len(replayed) > 1000
    assert next(at for at, _, estimate in replayed if estimate is not None) == 88.0
    assert _misses(replayed, since=SLOWER_SEEN) == []


@pytest.mark.parametrize("killed_at", [100.0, 400.0, 700.0, 900.0, 1000.0])
def test_time_left_after_a_resume_shows_at_once_and_keeps_its_bounds(killed_at: float) -> None:
    """The same run killed at `killed_at` and started again 100 s later: the items in flight at the kill computed
    again, the others as long as they took. A figure from the resumed run's first second, within the bounds
    throughout (killed at 100 s, the only decodes timed before are the first chunk's fast two: from 202 s of the
    first attempt's work on, as above)."""
    first, second = timelines.resumed(_lines(CLIP250), killed_at, killed_at + 100.0)
    restart = killed_at + 100.0
    replayed = timelines.replay(PLAN, timelines.streamed(second, restart), restart, first)
    assert replayed[0][2] is not None
    shift = min(line["start"] for line in _lines(CLIP250) if line["end"] > killed_at)
    since = SLOWER_SEEN - shift if killed_at < SLOWER_SEEN else 0.0
    assert _misses(replayed, since=since) == []


# Recorded 2026-12-07 with bench/time_left_live.py on the two-core host with nothing else running: the same
# 250-frame clip as `CLIP250` (`PLAN`), run whole (212 s; its decodes 17 to 19 s each), then run again killed at 117 s
# and resumed (the run's `attempt` says which).
QUIET = Path(__file__).parents[1] / "data" / "clip250-quiet-timeline.jsonl"
QUIET_RESUMED = Path(__file__).parents[1] / "data" / "clip250-quiet-resumed-timeline.jsonl"


def test_on_a_steady_host_the_time_left_holds_its_bounds_from_its_first_figure() -> None:
    """Where the host's load holds, the figure is within the bounds from the first decode's end (23 s) to the end:
    the misses of `CLIP250`'s replay are its host's load rising after the first decodes, which no record shows."""
    replayed = timelines.replay(PLAN, _lines(QUIET), 0.0)  # its blends' lines as a streaming run writes them
    first = next(at for at, _, estimate in replayed if estimate is not None)
    assert first == 23.0
    assert _misses(replayed, since=first) == []


def test_on_a_steady_host_a_resumed_run_has_a_figure_at_once_within_its_bounds() -> None:
    """The resumed attempt (its first line 5 s after the command started again; 111 s of work left), replayed from
    its first line: a figure at once (106 s), and every figure within the bounds to the end (at worst 5 s off)."""
    lines = _lines(QUIET_RESUMED)
    first, second = [line for line in lines if line["attempt"] == 0], [line for line in lines if line["attempt"] == 1]
    start = min(line["start"] for line in second)
    replayed = timelines.replay(PLAN, second, start, first)
    assert replayed[0][2] is not None
    assert _misses(replayed) == []


# A 97-frame 64x448 clip: one window of the tiny model's 5 tiles, each its own chunk.
FIVE = make_plan((64, 448), 97, 24.0, parse_params(scale="2"), ModelTraits(tile_sizes=TINY_TILE_SIZES))


def _shared_lines() -> list[dict]:
    """A run of `FIVE` on a device its items share: an item takes twice as long beside another as alone (a denoise 10
    s alone, a decode 44 s). Its lane of two takes the tiles two by two, as the scheduler grants them (decodes
    first), so tiles 0 to 3 go in pairs (20 s denoises, 88 s decodes) and tile 4 alone, its denoise and decode
    twice as fast as their pairs were."""
    spans = [("encode", "0", 0.0, 10.0)]
    for pair, at in ((0, 10.0), (2, 118.0)):
        for tile in (pair, pair + 1):
            spans += [("denoise", f"0-{tile}", at, at + 20.0), ("decode", f"0-{tile}", at + 20.0, at + 108.0)]
    spans += [("denoise", "0-4", 226.0, 236.0), ("decode", "0-4", 236.0, 280.0)]
    spans += [("blend", "0", 280.0, 282.0), ("segment", "0", 282.0, 285.0), ("mux", "all", 285.0, 286.0)]
    return [{"stage": stage, "item": item, "start": start, "end": end} for stage, item, start, end in spans]


def test_a_lone_last_item_counts_at_the_pace_of_the_device_to_itself() -> None:
    """The items in flight share the device: a pace timed while two ran is two items' share, so the last tile, alone
    on the lane, is counted at twice that pace (taken at its pair's, the estimate was 48 s high throughout: 216 s
    for the last 168, 108 s for the last 60). From the first decodes' end on, every estimate within the bounds."""
    assert (FIVE.num_windows, FIVE.num_tiles, len(FIVE.chunks)) == (1, 5, 5)
    replayed = timelines.replay(FIVE, timelines.streamed(_shared_lines()), 0.0)
    assert next(at for at, _, estimate in replayed if estimate is not None) == 118.0
    assert _misses(replayed) == [(at, 286 - at, None) for at in range(118)]


@pytest.mark.parametrize("killed_at", [150.0, 240.0])
def test_a_resumed_runs_lone_last_item_counts_at_the_pace_of_the_device_to_itself(killed_at: float) -> None:
    """Killed with the third pair's decodes in flight (150 s) or the last decode (240 s), started again 100 s later:
    from its first second, the estimate counts the earlier attempt's paired decodes as pairs' shares, and the last
    tile alone at twice their pace."""
    first, second = timelines.resumed(_shared_lines(), killed_at, killed_at + 100.0)
    restart = killed_at + 100.0
    replayed = timelines.replay(FIVE, timelines.streamed(second, restart), restart, first)
    assert _misses(replayed) == []


# Recorded 2026-12-06: the tiny model on a 250-frame 64x64 clip (three windows of one tile) on the shared two-core
# host (load average 8 to 14), killed as window 0's decode ended and started again; `attempt` says which.
CLIP64 = Path(__file__).parents[1] / "data" / "clip64-resumed-timeline.jsonl"
PLAN64 = make_plan((64, 64), 250, 24.0, parse_params(scale="2"), ModelTraits(tile_sizes=TINY_TILE_SIZES))


def test_a_recorded_resumed_run_counts_what_its_killed_attempt_had_in_flight() -> None:
    """The killed attempt recorded one decode (132 s), which ran beside window 1's decode, lost at the kill and
    recorded by no line: counted as having had the device alone, it made the estimate 93 s high at the resumed
    run's start. Replayed from the resumed attempt's first line: a figure at once, within 30 s or a quarter (the
    more) throughout (its decodes ran slower than the killed attempt's: the host's load rose, which its first
    records cannot show), and within the issue's bounds from its own first decode on."""
    lines = _lines(CLIP64)
    first, second = [line for line in lines if line["attempt"] == 0], [line for line in lines if line["attempt"] == 1]
    start = min(line["start"] for line in second)
    replayed = timelines.replay(PLAN64, second, start, first)
    assert replayed[0][2] is not None
    assert [(at, actual, left) for at, actual, left in replayed if abs(left - actual) > max(30.0, actual / 4)] == []
    own = min(line["end"] for line in second if line["stage"] == "decode") - start
    assert _misses(replayed, since=own) == []


def test_a_slot_that_never_freed_holds_its_item_since_the_run_began() -> None:
    """Two slots from 0 s: a decode took one then and still runs (no record); the other slot's encode (0-8 s) and
    denoise (8-31 s) freed it for the decode in flight since 31 s. The latest two ends (8 and 31 s) would say the
    first decode started at 8 s, as the recorded resumed run's did (its first line is that pair, at 206 s)."""
    assert _slots_free([(0.0, 8.0), (8.0, 31.0)], 2, 0.0) == [0.0, 31.0]
    assert _slots_free([(0.0, 10.0), (0.0, 12.0), (10.0, 20.0)], 2, 0.0) == [12.0, 20.0]  # each freed since
    assert _slots_free([], 2, 5.0) == [5.0, 5.0]


def test_beside_other_clips_every_item_counts_at_the_pace_it_was_timed_at() -> None:
    """An archive's clips in flight together share one model queue, and a clip's records show none of the others'
    items: a slot its own items leave, another clip's takes. The device counted full, the last tile of `FIVE` (its
    denoise and decode alone on its own lane) counts at its pair's pace, 108 s, not the 54 s it takes alone."""
    lines = _shared_lines()
    now = 226.0
    spans = [Span.of_line(line) for line in lines if line["end"] <= now]
    done = _done(*spans)
    assert seconds_left(FIVE, done, spans, now, 0.0) == pytest.approx(10.0 + 44.0)
    assert seconds_left(FIVE, done, spans, now, 0.0, shared=True) == pytest.approx(20.0 + 88.0)
