"""What runs show in the Prefect UI: stage spans on the run's clock, progress texts, keys, reports and the manifest
table; and, against a real server, that each clip run owns its artifacts and its progress counts every tile."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import numpy as np

from flows import artifacts
from flows.stage_clock import PIPELINE, StageClock
from k6vsr_core.contract.params import parse_params
from k6vsr_core.contract.plan import ModelTraits, make_plan
from k6vsr_core.model.tiny_bundle import TINY_TILE_SIZES
from service.runs import ModelSpec
from storage import RunStore
from storage.progress import RunProgress, StageCount, run_finished

# 250 frames at 24 fps: three windows of the tiny model's 6 tiles each (128x96 at x2).
PLAN = make_plan((96, 128), 250, 24.0, parse_params(scale="2"), ModelTraits(tile_sizes=TINY_TILE_SIZES))
ONE_WINDOW = make_plan((96, 128), 1, 24.0, parse_params(scale="2"), ModelTraits(tile_sizes=TINY_TILE_SIZES))
STAGE_ROW = re.compile(r"^\| (\w+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (\d*) \|$", re.MULTILINE)


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _clock(events: list[tuple[float, str, float]]) -> StageClock:
    """A clock that saw `stage` tasks end at `at` seconds after the run's start, having worked `seconds`."""
    time = FakeTime()
    clock = StageClock(now=time)
    for at, stage, seconds in events:
        time.now = 1000.0 + at
        clock.finished(stage, seconds)
    return clock


def test_spans_follow_the_pipeline_and_add_up_to_the_run() -> None:
    # Two threads: chunk 1 denoises while tile 0 decodes; blend waits for the last decode.
    clock = _clock(
        [
            (0.5, "ingest", 0.4),
            (1.5, "encode", 0.9),
            (3.0, "denoise", 1.4),
            (4.5, "denoise", 1.4),
            (3.8, "decode", 0.8),
            (5.2, "decode", 0.7),
            (5.6, "blend", 0.3),
            (6.0, "mux", 0.3),
            (6.1, "publish", 0.1),
        ]
    )
    spans = clock.spans()
    assert [s.stage for s in spans] == ["ingest", "encode", "denoise", "decode", "blend", "mux", "publish"]
    by_stage = {s.stage: s for s in spans}
    assert (by_stage["denoise"].starts, by_stage["denoise"].ends, by_stage["denoise"].tasks) == (1.6, 4.5, 2)
    assert (by_stage["decode"].starts, by_stage["decode"].ends) == (3.0, 5.2)
    # Spans overlap; what each stage adds does not: decode adds only what it ran after the last chunk.
    assert sum(s.span for s in spans) > 6.1
    assert round(by_stage["decode"].adds, 6) == 0.7
    assert round(sum(s.adds for s in spans), 6) == 6.1
    assert clock.task_seconds()["denoise"] == 2.8


def test_a_task_of_several_stages_places_each_where_it_ended() -> None:
    """A blend-segment task that returns at 6.0 s after a blend that ended at 4.0 s (1.0 s of work), a segment at
    5.5 s (1.5 s) and a quality part at 6.0 s (0.5 s): each stage spans its own seconds, not the task's end."""
    time = FakeTime()
    clock = StageClock(now=time)
    time.now = 1006.0
    for stage, seconds, ends_before in (("blend", 1.0, 2.0), ("segment", 1.5, 0.5), ("quality", 0.5, 0.0)):
        clock.finished(stage, seconds, ends_before)
    spans = {s.stage: (s.starts, s.ends) for s in clock.spans()}
    assert spans == {"blend": (3.0, 4.0), "segment": (4.0, 5.5), "quality": (5.5, 6.0)}


def test_printed_adds_sum_exactly_to_the_last_end() -> None:
    clock = _clock([(0.123, "ingest", 0.1), (0.456, "encode", 0.2), (0.789, "decode", 0.2), (0.7891, "denoise", 0.3)])
    printed = [float(f"{s.adds:.2f}") for s in clock.spans()]
    assert round(sum(printed), 2) == float(f"{clock.spans()[-1].ends:.2f}") == 0.79
    assert [s.stage for s in clock.spans()] == ["ingest", "encode", "denoise", "decode"]


def test_a_stage_the_pipeline_does_not_name_comes_last_and_reused_tasks_take_no_time() -> None:
    clock = _clock([(1.0, "verify", 0.5), (2.0, "ingest", 0.0), (2.5, "publish", 0.2)])
    assert [(s.stage, s.starts, s.ends) for s in clock.spans()] == [
        ("ingest", 2.0, 2.0),
        ("publish", 2.3, 2.5),
        ("verify", 0.5, 1.0),
    ]
    assert clock.spans()[-1].adds == 0.0


def test_percent_reaches_exactly_100() -> None:
    assert [artifacts.percent(done, 7) for done in (0, 7)] == [0.0, 100.0]
    assert artifacts.percent(2, 3) < 100.0 and artifacts.percent(0, 0) == 100.0


def test_archive_progress_follows_clips_as_they_start_and_end(tmp_path: Path, monkeypatch) -> None:
    """The artifact says what the terminal's lines say: the clips, then where each running clip stands. Clips that
    start and end are shown by the next poll, not each by a request of its own, and the end is shown at once."""
    shown: list[tuple[float, str]] = []
    monkeypatch.setattr(artifacts, "create", lambda kind, key, data, text, run: shown.append((data, text)) or "id")
    monkeypatch.setattr(artifacts, "update", lambda artifact, data, text: shown.append((data, text)))
    plans = {"b": ONE_WINDOW}
    monkeypatch.setattr(artifacts, "stored_plan", lambda store: plans.get(store.run_key))
    stores = {name: RunStore(tmp_path, name) for name in "abc"}
    progress = artifacts.ArchiveProgress("nightly-abc123", "run-id", 3)
    with progress.watching(every_s=3600):  # no poll comes: three changes, one request as the block ends
        progress.started("a.mp4", stores["a"])
        progress.started("b.mp4", stores["b"])
        progress.finished("a.mp4", failed=False)
        assert len(shown) == 1
    assert [text for _, text in shown] == [
        "clips: 0 done, 0 failed, 3 left",
        "clips: 1 done, 0 failed, 2 left · b.mp4: ingest · 0 of 6 tiles",
    ]
    folder = stores["b"].path / "done" / "ingest"
    folder.mkdir(parents=True)
    (folder / "all.json").write_text("{}")
    with progress.watching(every_s=0.01):
        deadline = time.monotonic() + 5
        while "encode" not in shown[-1][1] and time.monotonic() < deadline:
            time.sleep(0.01)
    assert shown[-1][1] == "clips: 1 done, 0 failed, 2 left · b.mp4: encode · 0 of 6 tiles"  # seen while it runs
    sent = len(shown)
    with progress.watching(every_s=3600):
        progress.finished("b.mp4", failed=True)
        progress.started("c.mp4", stores["c"])
        progress.finished("c.mp4", failed=False)
    assert [text for _, text in shown[sent:]] == ["clips: 2 done, 1 failed, 0 left"]
    assert shown[-1][0] == 100.0 and shown[-2][0] < 100.0


def test_keys_name_the_clip_and_the_run(tmp_path: Path) -> None:
    key = artifacts.clip_key("clip-report", str(tmp_path / "a" / "Dawn Take 2.MP4"), "0123456789ABCDEF")
    assert re.fullmatch(r"clip-report-dawn-take-2-mp4-[0-9a-f]{6}-01234567", key)
    copy = artifacts.clip_key("clip-report", str(tmp_path / "b" / "Dawn Take 2.MP4"), "0123456789ABCDEF")
    other_run = artifacts.clip_key("clip-report", str(tmp_path / "a" / "Dawn Take 2.MP4"), "fedcba9876543210")
    assert len({key, copy, other_run}) == 3


def _report(**changes) -> artifacts.ClipReport:
    frame = np.zeros((48, 64, 3), np.uint8)
    values = dict(
        source="/in/dawn.mp4",
        run_key="ab" * 12,
        frames=9,
        fps=24,
        before=frame,
        after=np.zeros((96, 128, 3), np.uint8),
        stages=_clock(
            [
                (0.5, "ingest", 0.4),
                (1.0, "encode", 0.4),
                (3.0, "denoise", 2.0),
                (3.2, "decode", 1.0),
                (3.4, "blend", 0.1),
                (3.6, "mux", 0.2),
                (3.7, "publish", 0.05),
            ]
        ).spans(),
        run_seconds=3.75,
        tiles_total=6,
        tiles_computed=4,
        tiles_reused=2,
        items={
            "ingest": StageCount(computed=0, reused=1),
            "denoise": StageCount(computed=4, reused=2),
            "decode": StageCount(computed=4, reused=2),
        },
        workers="2 threads in process 1 on h",
        output="/out/dawn_sr2x.mp4",
        output_bytes=3 * 1024 * 1024,
        store="/store/runs/abab",
    )
    return artifacts.ClipReport(**{**values, **changes})


def test_clip_report_lists_stages_in_order_within_the_run() -> None:
    markdown = artifacts.clip_report_markdown(_report())
    rows = STAGE_ROW.findall(markdown)
    assert [row[0] for row in rows] == ["ingest", "encode", "denoise", "decode", "blend", "mux", "publish", "run"]
    adds = [float(row[4]) for row in rows[:-1]]
    assert round(sum(adds), 2) == float(rows[-2][2]) <= float(rows[-1][2]) == 3.75
    assert markdown.count("](data:image/jpeg;base64,") == 2
    assert "before (64x48)" in markdown and "after (128x96)" in markdown
    assert "`/out/dawn_sr2x.mp4` (3.0 MiB)" in markdown and "`/store/runs/abab`" in markdown
    assert "| 6 | 4 | 2 |" in markdown and "2 threads in process 1 on h" in markdown
    assert "| stage | items | computed | reused |" in markdown
    assert "| ingest | 1 | 0 | 1 |" in markdown and "| decode | 6 | 4 | 2 |" in markdown
    assert "published from the finished run" in artifacts.clip_report_markdown(_report(reused_output=True))


def test_clip_report_of_a_latent_shows_the_output_alone() -> None:
    """A latent run has no source frame: the report shows the output's still and says what the input was."""
    markdown = artifacts.clip_report_markdown(_report(source="/in/shot.safetensors", before=None))
    assert markdown.count("](data:image/jpeg;base64,") == 1
    assert "output (128x96)" in markdown and "a latent to 128x96" in markdown and "before (" not in markdown


def test_manifest_table_links_clip_runs_and_puts_long_text_last(tmp_path: Path) -> None:
    from flows.archive.report import manifest_markdown
    from flows.archive.rows import ArchiveRow

    out = tmp_path / "out"
    rows = [
        ArchiveRow(
            source="/in/a.mp4",
            relative_path="a.mp4",
            status="done",
            run_key="r" * 24,
            frames=1,
            tiles=6,
            tiles_computed=6,
            tiles_reused=0,
            seconds=3.25,
            output=str(out / "a_sr2x.mp4"),
        ),
        ArchiveRow(
            source="/in/b|c.mp4",
            relative_path="b|c.mp4",
            status="skipped",
            reason="/in/b|c.mp4: not a readable media file",
        ),
    ]
    header = {"input": "/in", "output_dir": str(out)}
    markdown = manifest_markdown(header, rows, {"a.mp4": "1234-run"}, "1 done, 1 skipped")
    lines = markdown.splitlines()
    head = next(line for line in lines if line.startswith("| clip"))
    assert head.split(" | ")[:6] == ["| clip", "status", "tiles", "computed", "reused", "seconds"]
    assert head.endswith("| reason |")
    # The link is absolute when the UI's address is known (PREFECT_UI_URL, or derived from PREFECT_API_URL).
    row = next(line for line in lines if line.startswith("| [a.mp4]("))
    assert row.endswith("/runs/flow-run/1234-run) | done | 6 | 6 | 0 | 3.2 | a_sr2x.mp4 | rrrrrrrrrrrr |  |")
    assert r"| b\|c.mp4 | skipped |  |  |  |  |  |  | not a readable media file |" in lines
    assert "1 done, 1 skipped" in markdown and str(out / "k6vsr-archive-manifest") in markdown


# --------------------------------------------------------------------------------------------------- with Prefect


def test_tile_progress_says_each_moment_once_even_when_two_tiles_finish_together(monkeypatch) -> None:
    sent: list[tuple[float, str]] = []
    monkeypatch.setattr(artifacts, "create", lambda kind, key, data, text, run: sent.append((data, text)))
    monkeypatch.setattr(artifacts, "update", lambda artifact_id, data, text: sent.append((data, text)))
    progress = artifacts.TileProgress("clip.mp4", "key", None, RunProgress("encode", 0, 3, 0, 18))
    # Two decodes end at once: both futures read the store after both finished, so both see 8.
    for stage, window, done in [("denoise", 0, 0), ("decode", 1, 7), ("decode", 1, 8), ("decode", 1, 8)]:
        progress.update(RunProgress(stage, window, 3, done, 18))
    progress.update(run_finished(PLAN))
    assert sent == [
        (0.0, "encode · window 1 of 3 · 0 of 18 tiles"),
        (0.0, "denoise · window 1 of 3 · 0 of 18 tiles"),
        (100 * 7 / 18, "decode · window 2 of 3 · 7 of 18 tiles"),
        (100 * 8 / 18, "decode · window 2 of 3 · 8 of 18 tiles"),
        (100.0, "done · 18 of 18 tiles"),
    ]


def test_each_clip_run_owns_its_artifacts(
    prefect_server: str, tiny_bundle_path: Path, clip_1f: Path, tmp_path: Path, monkeypatch
) -> None:
    """A clip and its copy share a run key but not their artifacts; progress counts every decoded tile, at most
    once per interval and the end at once."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.runtime import flow_run

    from flows.orchestrate import run_clip
    from flows.upscale_clip import PROGRESS_EVERY_S
    from k6vsr_core.contract.params import UpscaleParams
    from service.runs import prepare_run

    updates: list[tuple[str, object, str]] = []
    sent_at: dict[str, list[float]] = {}
    real_update = artifacts.update

    real_create = artifacts.create

    def recording(artifact_id, data, description):
        updates.append((flow_run.id, data, description))
        sent_at.setdefault(flow_run.id, []).append(time.monotonic())
        real_update(artifact_id, data, description)

    def recording_progress(kind, key, data, description, run):  # a run's progress artifact is made by its first state
        if kind == "progress":
            updates.append((flow_run.id, data, description))
            sent_at.setdefault(flow_run.id, []).append(time.monotonic())
        return real_create(kind, key, data, description, run)

    monkeypatch.setattr(artifacts, "update", recording)
    monkeypatch.setattr(artifacts, "create", recording_progress)
    run_ids = []
    monkeypatch.setattr(artifacts, "workers_in_use", lambda: run_ids.append(flow_run.id) or "test workers")

    copy = tmp_path / "copies" / clip_1f.name
    copy.parent.mkdir()
    shutil.copyfile(clip_1f, copy)
    model = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    summaries = [
        run_clip(
            prepare_run(source, UpscaleParams(scale=2), model, tmp_path / "s"), str(tmp_path / f"out-{n}.mp4"), model
        ).summary()
        for n, source in enumerate((clip_1f, copy))
    ]
    assert summaries[0].run_key == summaries[1].run_key and summaries[1].tiles_reused == summaries[1].tiles_total
    total = summaries[0].tiles_total
    # The first run names its stages as they are when it sends, in pipeline order, at most once per interval and
    # the end at once, and counts up to every tile, never saying the same twice (two tiles may finish together);
    # the second, which decodes nothing, says at once it is done.
    first = [(data, text) for run, data, text in updates if run == run_ids[0]]
    texts = [text for _, text in first]
    assert len(texts) == len(set(texts)), texts
    stages = [text.split(" · ")[0] for text in texts]
    order = [*PIPELINE, "done"]
    assert [order.index(stage) for stage in stages] == sorted(order.index(stage) for stage in stages), texts
    assert texts[-1] == f"done · {total} of {total} tiles", texts
    times = sent_at[run_ids[0]][:-1]
    assert all(b - a >= PROGRESS_EVERY_S - 0.1 for a, b in zip(times, times[1:], strict=False)), times
    counts = [int(text.split(" · ")[-1].split(" of ")[0]) for text in texts]
    assert counts == sorted(counts) and first[-1][0] == 100.0
    assert all(data == artifacts.percent(n, total) for n, (data, _) in zip(counts, first, strict=True))
    second = [(data, text) for run, data, text in updates if run == run_ids[1]]
    assert second == [(100.0, f"done · {total} of {total} tiles")]

    keys = set()
    with get_client(sync_client=True) as client:
        for run_id, source in zip(run_ids, (clip_1f, copy), strict=True):
            found = client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
            )
            assert {a.type for a in found} == {"progress", "markdown"} and len(found) == 2
            assert all(a.task_run_id is None for a in found)
            progress = next(a for a in found if a.type == "progress")
            assert float(progress.data) == 100.0 and progress.description == f"done · {total} of {total} tiles"
            report = next(a for a in found if a.type == "markdown")
            assert report.key == artifacts.clip_key("clip-report", str(source), summaries[0].run_key)
            assert "test workers" in report.data and str(tmp_path.resolve()) in report.data
            run = client.read_flow_run(run_id)
            rows = STAGE_ROW.findall(report.data)
            assert float(rows[-1][2]) <= (run.end_time - run.start_time).total_seconds()
            keys |= {a.key for a in found}
    assert len(keys) == 4


def test_the_report_counts_a_flow_runs_threads_without_prefects_private_count(monkeypatch) -> None:
    from prefect.settings import PREFECT_TASKS_RUNNER_THREAD_POOL_MAX_WORKERS, temporary_settings
    from prefect.task_runners import ThreadPoolTaskRunner

    from runtime.runners import MODEL_SLOTS, USE_WARM_ENV, CountedThreadPool, make_task_runner, thread_count

    monkeypatch.setenv(USE_WARM_ENV, "off")
    runner = make_task_runner()
    assert isinstance(runner, CountedThreadPool) and thread_count(runner) == MODEL_SLOTS
    assert thread_count(runner.duplicate()) == MODEL_SLOTS
    with temporary_settings(updates={PREFECT_TASKS_RUNNER_THREAD_POOL_MAX_WORKERS: None}):
        assert thread_count(ThreadPoolTaskRunner()) is None
    with temporary_settings(updates={PREFECT_TASKS_RUNNER_THREAD_POOL_MAX_WORKERS: 3}):
        assert thread_count(ThreadPoolTaskRunner()) == 3
