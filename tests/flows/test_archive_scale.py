"""Archives at scale, at 20 clips: a finished clip is skipped with a stat and no plan, through the real archive flow;
and the bench-only stand-in for the networks runs the real flows, tasks and store (bench/archive_scale.py measures
the same at hundreds of clips)."""

from __future__ import annotations

import json
import os
import time
from contextvars import ContextVar
from pathlib import Path

import pytest

from bench import fake_model
from k6vsr_core import media
from k6vsr_core.contract.params import UpscaleParams
from k6vsr_core.media.sample import make_sample_clip
from service.runs import ModelSpec
from storage import RunStore

PARAMS = UpscaleParams(scale=2)
CLIPS = 20


def _clips(folder: Path, n: int) -> list[Path]:
    folder.mkdir(parents=True)
    return [
        make_sample_clip(folder / f"c{i:02d}.mp4", width=64, height=64, num_frames=1, audio=False, tone_hz=300.0 + i)
        for i in range(n)
    ]


def _finished(folder: Path, out: Path, model: ModelSpec, store: Path) -> list:
    """What an archive run that finished every clip leaves: the outputs and its manifest (planned, not computed)."""
    from flows.archive.planning import plan_clips
    from flows.archive.report import archive_header, write_manifest

    out.mkdir(parents=True, exist_ok=True)

    stamps: dict = {}
    rows, plans = plan_clips(folder, sorted(folder.glob("*.mp4")), out, PARAMS, model, str(store), False, stamps)
    assert len(plans) == len(rows) == len(stamps)
    done = []
    for row in rows:
        Path(row.output).write_bytes(b"an output")
        done.append(row.model_copy(update={"status": "done", "tiles_computed": row.tiles, "tiles_reused": 0}))
    header = archive_header(folder, out, str(store), PARAMS, model, False)
    header["sources"] = {path: stamp.model_dump() for path, stamp in stamps.items()}
    write_manifest(out, header, done)
    return done


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of the planner and of the source hash from the archive's planning on."""
    import flows.archive.planning as archive

    calls = {"prepare_run": 0, "source_info": 0}
    for name in calls:
        original = getattr(archive, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(archive, name, counted)
    return calls


def test_an_unchanged_finished_clip_is_reused_without_planning(
    tiny_bundle_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.archive.planning import plan_clips

    folder, out, store = tmp_path / "in", tmp_path / "out", tmp_path / "store"
    sources = _clips(folder, 3)
    model = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    done = _finished(folder, out, model, store)
    calls = _counting(monkeypatch)

    rows, plans = plan_clips(folder, sources, out, PARAMS, model, str(store), False)
    assert calls == {"prepare_run": 0, "source_info": 0} and plans == {}
    assert [(r.status, r.reason, r.run_key, r.tiles_reused) for r in rows] == [
        ("reused", "output exists", d.run_key, d.tiles) for d in done
    ]

    # A source touched since: planned (and hashed) in full; its bytes are the same, so its output is still its own.
    stat = sources[1].stat()
    os.utime(sources[1], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    rows, _ = plan_clips(folder, sources, out, PARAMS, model, str(store), False)
    assert calls["prepare_run"] == 1 and [r.status for r in rows] == ["reused"] * 3
    assert rows[1].reason == "output exists" and rows[1].run_key == done[1].run_key

    # Another request: every clip planned in full, and each row says its output came from another run.
    rows, _ = plan_clips(folder, sources, out, UpscaleParams(scale=2, seed=7), model, str(store), False)
    assert calls["prepare_run"] == 4
    assert all(r.status == "reused" and "parameters or model changed" in r.reason for r in rows)
    # Overwrite never takes the quick path.
    _, plans = plan_clips(folder, sources, out, PARAMS, model, str(store), True)
    assert calls["prepare_run"] == 7 and len(plans) == 3


@pytest.mark.timed
def test_a_finished_archive_of_20_clips_skips_each_clip_within_a_tenth_of_a_second(
    prefect_server: str, tiny_bundle_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real archive flow on a finished archive: no clip flow run, no plan, no hash; the flow's own cost over
    twenty clips, less that of one, is at most 0.1 s a clip."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    from flows.upscale_archive import upscale_archive

    store = tmp_path / "store"
    model = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    archives = {}
    for name, n in (("one", 1), ("all", CLIPS)):  # a finished archive of one clip, and one of twenty
        folder, out = tmp_path / name, tmp_path / f"{name}-out"
        _clips(folder, n)
        _finished(folder, out, model, store)
        archives[name] = dict(input_dir=str(folder), output_dir=str(out), params=PARAMS, model=model)
    calls = _counting(monkeypatch)

    upscale_archive(**archives["one"], store_root=str(store))  # the session's first flow run pays Prefect's first
    seconds = {}
    for name, kwargs in archives.items():
        started = time.perf_counter()
        state = upscale_archive(**kwargs, store_root=str(store), return_state=True)
        seconds[name] = time.perf_counter() - started

    summary = state.result()
    assert summary.counts == {"reused": CLIPS} and summary.message.startswith("nothing new to do")
    assert calls == {"prepare_run": 0, "source_info": 0}
    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[state.state_details.flow_run_id])
            )
        )
    assert children == []
    assert (seconds["all"] - seconds["one"]) / (CLIPS - 1) <= 0.1, seconds
    # The manifest keeps every stamp: the next rerun is as quick.
    assert len(json.loads(Path(summary.manifest_json).read_text())["sources"]) == CLIPS


def test_the_stand_in_runs_the_real_archive_flow(
    prefect_server: str, tiny_bundle_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the stand-in, an archive of a one-window and a two-window clip goes through the real flows, tasks and
    store: every item recorded, segments encoded and muxed at the real size; a rerun reuses both."""
    from flows.upscale_archive import upscale_archive

    monkeypatch.setenv("K6VSR_NETWORKS", fake_model.SPEC)
    monkeypatch.setenv("K6VSR_FAKE_MODEL_MS", "2")
    folder = tmp_path / "in"
    folder.mkdir()
    make_sample_clip(folder / "short.mp4", width=64, height=64, num_frames=1, audio=False)
    make_sample_clip(folder / "long.mp4", width=64, height=64, num_frames=122, audio=False)
    kwargs = dict(
        input_dir=str(folder),
        output_dir=str(tmp_path / "out"),
        params=PARAMS,
        model=ModelSpec(model=str(tiny_bundle_path), device="cpu"),
        store_root=str(tmp_path / "store"),
    )
    summary = upscale_archive(**kwargs)
    assert summary.counts == {"done": 2}
    rows = {row.relative_path: row for row in summary.rows}
    assert (rows["short.mp4"].tiles, rows["long.mp4"].tiles) == (1, 2)
    for name, frames in (("short.mp4", 1), ("long.mp4", 122)):
        row = rows[name]
        assert row.tiles_computed == row.tiles and row.frames == frames
        probe = media.probe(row.output)
        assert (probe.width, probe.height, probe.num_frames) == (128, 128, frames)
        store = RunStore(str(tmp_path / "store"), row.run_key)
        assert store.output_done()
        assert "+fake-model-2ms" not in row.run_key  # the key is a hash: the stand-in changes it, names nothing
    again = upscale_archive(**kwargs)
    assert again.counts == {"reused": 2}


@pytest.mark.timed
def test_tile_progress_is_sent_at_most_once_per_interval_and_the_end_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's stages and tiles cost one progress request per interval, not one a task: what comes within the
    interval waits and the newest of it is sent by a timer when the interval is up; the final state goes at once and
    nothing held back follows it."""
    from flows import artifacts
    from storage.progress import RunProgress

    sent: list[tuple[str, str]] = []
    api: ContextVar[str] = ContextVar("api", default="none")  # as Prefect's settings are: a context variable
    api.set("the run's")
    seen: list[str] = []

    def create(kind: str, key: str, data: float, text: str, run: object) -> str:
        sent.append(("create", text))
        seen.append(api.get())
        return "artifact-id"

    def update(artifact_id: object, data: float, text: str) -> None:
        sent.append(("update", text))
        seen.append(api.get())

    monkeypatch.setattr(artifacts, "create", create)
    monkeypatch.setattr(artifacts, "update", update)
    progress = artifacts.TileProgress("clip.mp4", "key", None, RunProgress("encode", 0, 2, 0, 18), 1.0)
    for done in range(1, 10):  # a stage, then nine decodes, then the next window, all within the first interval
        progress.update(RunProgress("decode", 0, 2, done, 18))
    progress.update(RunProgress("decode", 1, 2, 10, 18))
    assert sent == []  # the interval counts from the run's start
    deadline = time.monotonic() + 5
    while not sent and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sent == [("create", "decode · window 2 of 2 · 10 of 18 tiles")]  # only the newest, by the timer...
    assert seen == ["the run's"]  # ...to the run's API, not to one its thread would find without the run's settings
    progress.update(RunProgress("mux", 1, 2, 18, 18))  # within the next interval: held back...
    progress.finish(RunProgress("done", 1, 2, 18, 18))  # ...and dropped: the end is sent at once
    time.sleep(1.2)
    assert sent[1:] == [("update", "done · 18 of 18 tiles")]


def test_a_clip_shorter_than_the_interval_sends_its_progress_once(monkeypatch) -> None:
    from flows import artifacts
    from storage.progress import RunProgress

    sent: list[tuple[str, str]] = []
    monkeypatch.setattr(artifacts, "create", lambda kind, key, data, text, run: sent.append((kind, text)) or "id")
    monkeypatch.setattr(artifacts, "update", lambda artifact_id, data, text: sent.append(("update", text)))
    progress = artifacts.TileProgress("clip.mp4", "key", None, RunProgress("encode", 0, 1, 0, 1), 30.0)
    progress.update(RunProgress("decode", 0, 1, 1, 1))
    progress.finish(RunProgress("done", 0, 1, 1, 1))
    assert sent == [("progress", "done · 1 of 1 tile")]


def _status_error(status: int, message: str) -> Exception:
    import httpx
    from prefect.exceptions import PrefectHTTPStatusError

    request = httpx.Request("POST", "http://127.0.0.1/api/flow_runs/")
    response = httpx.Response(status, request=request, json={"exception_message": message})
    return PrefectHTTPStatusError.from_httpx_error(httpx.HTTPStatusError("busy", request=request, response=response))


def test_a_clip_the_busy_api_failed_runs_again_and_another_failure_does_not(
    prefect_server: str, tiny_bundle_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 503 from the Prefect API (SQLite locked under load) costs a clip a second run, not its row; a clip's own
    failure, even an API answer that retrying cannot change (404), is recorded at once."""
    import flows.archive.clip_runs as clip_runs
    import flows.upscale_archive as archive

    monkeypatch.setenv("K6VSR_NETWORKS", fake_model.SPEC)
    monkeypatch.setenv("K6VSR_FAKE_MODEL_MS", "1")
    monkeypatch.setattr(clip_runs, "API_BUSY_PAUSE_S", 0.0)
    folder = tmp_path / "in"
    _clips(folder, 2)
    from flows.orchestrate import ClipRun

    calls: list[str] = []
    original = clip_runs.run_clip

    def flaky(prepared, output, model, runner, context):
        relative_path = context.name.removeprefix("upscale-")
        calls.append(relative_path)
        if relative_path == "c00.mp4" and calls.count(relative_path) == 1:
            return ClipRun("", _status_error(503, "Service Unavailable"))
        if relative_path == "c01.mp4":
            raise _status_error(404, "Not Found")
        return original(prepared, output, model, runner, context)

    monkeypatch.setattr(clip_runs, "run_clip", flaky)
    state = archive.upscale_archive(
        input_dir=str(folder),
        output_dir=str(tmp_path / "out"),
        params=PARAMS,
        model=ModelSpec(model=str(tiny_bundle_path), device="cpu"),
        store_root=str(tmp_path / "store"),
        return_state=True,
    )
    assert state.is_failed()  # c01.mp4 failed
    rows = {
        row["relative_path"]: row
        for row in json.loads((tmp_path / "out" / "k6vsr-archive-manifest.json").read_text())["rows"]
    }
    assert rows["c00.mp4"]["status"] == "done" and Path(rows["c00.mp4"]["output"]).is_file()
    assert rows["c01.mp4"]["status"] == "failed" and "Not Found" in rows["c01.mp4"]["reason"]
    assert sorted(calls) == ["c00.mp4", "c00.mp4", "c01.mp4"]


def test_a_finished_clip_s_summary_is_not_kept_while_the_archive_runs(
    prefect_server: str, tiny_bundle_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The archive's memory grows with its rows only: each clip's summary (its quality report with it) is freed once
    the clip's row is made, not kept until the archive ends.

    The archive is handed a copy of each summary, which only it can hold: Prefect's own (the subflow's state, held
    for up to a minute by the cancelled timers of its HTTP calls, whose contexts keep the run's context) is not
    what is measured."""
    import gc
    import weakref

    import flows.archive.clip_runs as clip_runs
    import flows.upscale_archive as archive

    monkeypatch.setenv("K6VSR_NETWORKS", fake_model.SPEC)
    monkeypatch.setenv("K6VSR_FAKE_MODEL_MS", "1")
    folder = tmp_path / "in"
    _clips(folder, 3)
    handed: list[weakref.ref] = []
    alive_at_start: list[int] = []
    from flows.orchestrate import ClipRun

    original = clip_runs.run_clip

    def watched(*args, **kwargs):
        gc.collect()
        alive_at_start.append(sum(ref() is not None for ref in handed))
        ended = original(*args, **kwargs)
        copy = ended.summary().model_copy()
        handed.append(weakref.ref(copy))
        return ClipRun(ended.flow_run_id, copy)

    monkeypatch.setattr(clip_runs, "run_clip", watched)
    state = archive.upscale_archive(
        input_dir=str(folder),
        output_dir=str(tmp_path / "out"),
        params=PARAMS,
        model=ModelSpec(model=str(tiny_bundle_path), device="cpu"),
        store_root=str(tmp_path / "store"),
        max_parallel=1,
        return_state=True,
    )
    assert state.is_completed() and len(handed) == 3
    assert alive_at_start == [0, 0, 0]


def test_clip_runs_send_no_heartbeats_of_their_own_and_are_named_after_their_clip(
    prefect_server: str, tiny_bundle_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefect joins a run's heartbeat thread as it ends, up to a second a clip: the clip runs of an archive have
    none, the archive run keeps its own, and each clip run is still named after its clip's path."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.settings import get_current_settings

    import flows.upscale_archive as archive
    import flows.upscale_clip as clip

    monkeypatch.setenv("K6VSR_NETWORKS", fake_model.SPEC)
    monkeypatch.setenv("K6VSR_FAKE_MODEL_MS", "1")
    _clips(tmp_path / "in" / "sub", 2)
    seen: dict[str, list[int | None]] = {"archive": [], "clip": []}
    write_manifest, report = archive.write_manifest, clip._report

    def archive_writes(*args, **kwargs):
        seen["archive"].append(get_current_settings().flows.heartbeat_frequency)
        return write_manifest(*args, **kwargs)

    def clip_reports(*args, **kwargs):
        seen["clip"].append(get_current_settings().flows.heartbeat_frequency)
        return report(*args, **kwargs)

    monkeypatch.setattr(archive, "write_manifest", archive_writes)
    monkeypatch.setattr(clip, "_report", clip_reports)
    state = archive.upscale_archive(
        input_dir=str(tmp_path / "in"),
        output_dir=str(tmp_path / "out"),
        params=PARAMS,
        model=ModelSpec(model=str(tiny_bundle_path), device="cpu"),
        store_root=str(tmp_path / "store"),
        return_state=True,
    )
    assert state.is_completed()
    default = get_current_settings().flows.heartbeat_frequency
    assert default is not None and seen["archive"][0] == default  # the plan's manifest, as the archive run began
    assert seen["clip"] == [None, None]
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[state.state_details.flow_run_id])
            )
        )
    assert sorted(run.name for run in runs) == ["upscale-sub/c00.mp4", "upscale-sub/c01.mp4"]
