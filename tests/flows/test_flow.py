"""The resumable pipeline: the clip flow matches the in-memory runner byte for byte and resumes from the store."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import procs
import pytest
import timelines

from entrypoints.console import summary_lines
from k6vsr_core import UpscaleParams
from k6vsr_core.device.compute import default_profile
from k6vsr_core.model.bundle import model_traits
from service.runs import ModelSpec, prepare_run
from storage import RunStore, run_key
from storage.records import RecordBook, array_checksum

PARAMS = UpscaleParams(scale=2)


def _run(clip: Path, out: Path, bundle_path: Path, store: Path, **where):
    """`k6vsr upscale`'s way: the tiles where `where` (workers, gpus, dask_address) says."""
    from flows.orchestrate import run_clip, tile_runner

    model = ModelSpec(model=str(bundle_path), device="cpu")
    prepared = prepare_run(clip, PARAMS, model, store)
    return run_clip(prepared, str(out), model, tile_runner(model, prepared, **where)).summary()


@contextmanager
def _preload_lines() -> Iterator[list[logging.LogRecord]]:
    """The lines of the model preload logged while the block runs (a handler on its own logger: Prefect's logging
    setup replaces the root logger's handlers, pytest's among them)."""
    lines: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record) if record.getMessage().startswith("preload ") else None
    logger = logging.getLogger("k6vsr.workers")
    # A logging configuration applied by an earlier test in this process may have disabled the logger; `setLevel`
    # (not the attribute) also drops the answers loggers cache, which an earlier test's lines may have filled.
    disabled, logger.disabled, level = logger.disabled, False, logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield lines
        # The preload thread may still be on its way to its line when a tiny run has already ended.
        for thread in threading.enumerate():
            if thread.name == "k6vsr-preload":
                thread.join(timeout=60)
    finally:
        logger.removeHandler(handler)
        logger.disabled = disabled
        logger.setLevel(level)


# --------------------------------------------------------------------------------------------------- store


def test_run_key_is_stable_and_sensitive() -> None:
    base = run_key("abc", PARAMS, "model@1")
    assert base == run_key("abc", UpscaleParams(scale=2), "model@1")
    assert base != run_key("abd", PARAMS, "model@1")
    assert base != run_key("abc", UpscaleParams(scale=2, seed=43), "model@1")
    assert base != run_key("abc", UpscaleParams(scale=2, tiles_batch_size=2), "model@1")
    assert base != run_key("abc", PARAMS, "model@2")


def test_damaged_record_or_chunk_reads_as_not_done(tmp_path: Path) -> None:
    store = RunStore(tmp_path, "k")
    value = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    store.put_tile("tile_latents", (0, 1), (2, 3), value, stage="denoise")
    assert np.array_equal(store.get_tile("tile_latents", (0, 1), stage="denoise"), value)
    assert store.tile_done("tile_latents", (0, 1), stage="denoise")
    chunk = next(p for p in (store.path / "data.zarr" / "tile_latents" / "c" / "0" / "1").rglob("*") if p.is_file())
    chunk.write_bytes(chunk.read_bytes()[:10])  # a torn write
    assert store.get_tile("tile_latents", (0, 1), stage="denoise") is None
    store.put_tile("tile_latents", (0, 1), (2, 3), value, stage="denoise")
    store.records.path("denoise", "0-1").write_text("{not json")
    assert store.get_tile("tile_latents", (0, 1), stage="denoise") is None
    assert not store.tile_done("tile_latents", (0, 1), stage="denoise")


def test_dropped_window_is_no_longer_stored_but_stays_recorded(tmp_path: Path) -> None:
    store = RunStore(tmp_path, "k")
    value = np.ones((2, 3), dtype=np.float32)
    for key in ((0, 0), (0, 1), (1, 0)):
        store.put_tile("tiles", key, (2, 2), value, stage="decode")
    store.drop_window(["tiles"], 0)
    assert not store.tile_done("tiles", (0, 1), stage="decode") and store.records.read("decode", "0-1") is not None
    assert np.array_equal(store.get_tile("tiles", (1, 0), stage="decode"), value)


def test_store_answers_what_an_attempt_computed(tmp_path: Path) -> None:
    store = RunStore(tmp_path, "k")
    value = np.zeros((2, 3), dtype=np.float32)
    for tile, attempt in ((0, "first"), (1, "second"), (2, "first")):
        store.put_tile("tile_latents", (0, tile), (1, 3), value, stage="denoise", seconds=0.5, attempt=attempt)
    store.put_tile("tiles", (0, 2), (1, 3), value, stage="decode", seconds=0.5, attempt="second")
    computed = {attempt: store.records.computed(attempt) for attempt in ("first", "second", "third")}
    assert computed == {
        "first": {"denoise": {"0-0", "0-2"}},
        "second": {"denoise": {"0-1"}, "decode": {"0-2"}},
        "third": {},
    }
    assert store.attempt_of("denoise", "0-1") == "second" and store.attempt_of("mux") is None
    assert store.tiles_decoded() == 1 and store.decoded_per_window(2) == [1, 0]


def test_records_are_written_atomically(tmp_path: Path) -> None:
    book = RecordBook(tmp_path)
    book.write("decode", "3", array_checksum(np.zeros(3)))
    assert [p.name for p in (tmp_path / "decode").iterdir()] == ["3.json"]  # no temporary left behind
    assert book.read("decode", "3").checksum == array_checksum(np.zeros(3))


# --------------------------------------------------------------------------------------------------- flow


def test_flow_output_equals_runner_and_reuses_everything(
    prefect_server: str,
    tiny_bundle_path: Path,
    clip_1f: Path,
    reference: bytes,
    tmp_path: Path,
    plan_calls: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _preload_lines() as preloads:
        first = _run(clip_1f, tmp_path / "a.mp4", tiny_bundle_path, tmp_path / "store")
    # Its tiles compute in this process: the model was loaded beside the flow's start, in a thread of its own.
    assert [r.threadName for r in preloads] == ["k6vsr-preload"] and "loaded" in preloads[0].getMessage()
    # One plan per run: `prepare_run` makes it, ingest records it, every task reads it from the manifest.
    assert len(plan_calls) == 1
    assert (tmp_path / "a.mp4").read_bytes() == reference
    assert (first.tiles_computed, first.tiles_reused) == (first.tiles_total, 0)
    assert first.dit_calls == 2 * first.tiles_total
    assert f"run {first.run_key}: 1 frame in 1 window of 6 tiles" in Path(first.log).read_text()
    assert RunStore(tmp_path / "store", first.run_key).read_manifest().compute == default_profile()
    # A tile is decoded as soon as its chunk is denoised, not once every chunk is (runtime.schedule).
    ran = timelines.spans(RunStore(tmp_path / "store", first.run_key).path)
    assert ran[("decode", "0-0")][0] < max(end for (stage, _), (_, end) in ran.items() if stage == "denoise")
    # The window's blend takes its tiles as they are decoded: it begins before the last decode ends.
    last_decode = max(end for (stage, _), (_, end) in ran.items() if stage == "decode")
    assert ran[("decode", "0-0")][1] <= ran[("blend", "0")][0] < last_decode <= ran[("blend", "0")][1]
    with _preload_lines() as preloads:
        again = _run(clip_1f, tmp_path / "b.mp4", tiny_bundle_path, tmp_path / "store")
    assert not preloads  # nothing to compute, nothing loaded
    assert len(plan_calls) == 2
    assert (tmp_path / "b.mp4").read_bytes() == reference
    assert (again.tiles_computed, again.tiles_reused, again.dit_calls) == (0, first.tiles_total, 0)
    assert not list(tmp_path.glob(".*partial"))


def test_run_clip_names_its_run_from_its_context_and_returns_a_failure(
    prefect_server: str, tiny_bundle_path: Path, clip_1f: Path, reference: bytes, tmp_path: Path
) -> None:
    """The one way to run a planned clip: its run context names the flow run (as the archive and an HTTP job name
    theirs), and a run that fails comes back with its error and its flow run, which the UI shows Failed."""
    from uuid import UUID

    from prefect.client.orchestration import get_client

    from flows.orchestrate import ClipRunContext, run_clip, tile_runner

    model = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    prepared = prepare_run(clip_1f, PARAMS, model, tmp_path / "store")
    ended = run_clip(prepared, str(tmp_path / "a.mp4"), model, tile_runner(model), ClipRunContext(name="job-42"))
    assert (tmp_path / "a.mp4").read_bytes() == reference and ended.summary().run_key == prepared.run.run_key
    unwritable = tmp_path / "a-file" / "out.mp4"  # its folder is a file: publishing fails
    unwritable.parent.write_bytes(b"")
    failed = run_clip(prepared, str(unwritable), model, tile_runner(model), ClipRunContext(name="job-43"))
    assert isinstance(failed.outcome, OSError)
    with pytest.raises(OSError):
        failed.summary()
    with get_client(sync_client=True) as client:
        runs = {run_id: client.read_flow_run(UUID(run_id)) for run_id in (ended.flow_run_id, failed.flow_run_id)}
    assert [(run.name, run.state.name) for run in runs.values()] == [("job-42", "Completed"), ("job-43", "Failed")]


def test_resume_after_kill_recomputes_only_unfinished_tiles(
    prefect_server: str, tiny_bundle_path: Path, clip_1f: Path, reference: bytes, tmp_path: Path
) -> None:
    """SIGKILL the command after two chunks are stored; the rerun reuses them and finishes the rest."""
    store, out = tmp_path / "store", tmp_path / "out"
    argv = [
        "upscale",
        str(clip_1f),
        "-o",
        str(out),
        "--output-file-name",
        "x.mp4",
        "--scale",
        "2",
        "--model",
        str(tiny_bundle_path),
        "--store",
        str(store),
        "--json",
    ]
    killer = textwrap.dedent(
        f"""
        import os, signal, sys, threading
        import tasks.stage_tasks as st
        plain, stored, lock = st.RunStore.put_tile, [], threading.Lock()
        def put_tile(self, name, index, *args, **kwargs):
            if name == "tiles":  # no decoded tile is stored before the kill, whichever thread is quicker
                threading.Event().wait()
            # One store at a time, so no other thread's tile lands between the second and the kill.
            with lock:
                plain(self, name, index, *args, **kwargs)
                if name == "tile_latents":
                    stored.append(index)
                    if len(stored) == 2:
                        os.kill(os.getpid(), signal.SIGKILL)
        st.RunStore.put_tile = put_tile
        from entrypoints.cli import main
        sys.exit(main({argv!r}))
        """
    )
    killed = procs.run([sys.executable, "-c", killer])
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (out / "x.mp4").exists()
    from entrypoints.cli import main

    rerun = procs.run(
        [sys.executable, "-m", "entrypoints.cli", *argv, "--verbose"],
    )
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    # --verbose: every task line
    assert "Task run 'denoise-decode-window-0-tiles-5' - Finished in state Completed()" in rerun.stderr
    summary = json.loads(rerun.stdout)
    # Two tiles' latents were stored, none decoded: the rerun denoises the others and decodes every tile. A chunk's
    # denoise and decode are one task here (runtime.lanes.Lanes.fuses): the two stored tiles are decoded alone.
    assert summary["items"]["denoise"] == {"computed": summary["tiles_total"] - 2, "reused": 2}
    assert (summary["tiles_computed"], summary["tiles_reused"]) == (summary["tiles_total"], 0)
    assert summary["dit_calls"] == 2 * summary["items"]["denoise"]["computed"]
    assert (out / "x.mp4").read_bytes() == reference
    assert main is not None


def test_a_run_resumed_from_a_moved_source_reads_it_where_it_is_now(tiny_bundle_path: Path, tmp_path: Path) -> None:
    """The run key is the content's, not the path's: ingested from one path, resumed from a copy after the first
    one is gone, the manifest (which every later stage reads the source from) names the copy."""
    import shutil

    from k6vsr_core.media.sample import make_sample_clip
    from tasks.ingest import ingest

    (tmp_path / "a").mkdir()
    first = make_sample_clip(tmp_path / "a" / "clip.mp4", width=64, height=64, num_frames=1)
    spec, params = ModelSpec(model=str(tiny_bundle_path)), UpscaleParams(scale=2)
    prepared = prepare_run(first, params, spec, tmp_path / "store")
    assert ingest.fn(prepared, "one").computed
    moved = tmp_path / "b" / "clip.mp4"
    moved.parent.mkdir()
    shutil.copy(first, moved)
    shutil.rmtree(first.parent)
    again = prepare_run(moved, params, spec, tmp_path / "store")
    assert again.run == prepared.run
    assert not ingest.fn(again, "two").computed
    assert RunStore(tmp_path / "store", again.run.run_key).read_manifest().source.path == str(moved.resolve())


def test_a_chunk_task_left_after_one_decoded_tile_resumes_the_other_tile_alone(
    tiny_bundle_path: Path, clip_1f: Path, tmp_path: Path
) -> None:
    """A chunk's denoise and its tiles' decodes are one task (`denoise-decode`), and each tile is still the unit of
    resume: an attempt killed after the chunk's latents and its first tile were stored leaves the next one only the
    second tile to decode, no DiT step; a third attempt computes nothing. Each stage's result says when it ended."""
    from tasks import stage_tasks
    from tasks.ingest import ingest

    spec = ModelSpec(model=str(tiny_bundle_path))
    with pytest.warns(UserWarning, match="not lossless"):
        prepared = prepare_run(clip_1f, UpscaleParams(scale=2, tiles_batch_size=2), spec, tmp_path / "store")
    run, chunk = prepared.run, prepared.plan.chunks[0]
    assert chunk.tiles == (0, 1)
    ingest.fn(prepared, "killed")
    stage_tasks.encode.fn(run, spec, 0, "killed")
    # What the killed attempt's task had stored: the chunk's latents, then its first tile.
    stage_tasks.denoise.fn(run, spec, 0, 0, "killed")
    stage_tasks.decode.fn(run, spec, 0, 0, "killed")
    resumed = stage_tasks.denoise_decode.fn(run, spec, 0, 0, "resumed", "0-1")
    assert [(r.stage, r.tiles, r.computed, r.dit_calls) for r in resumed] == [
        ("denoise", (0, 1), False, 0),
        ("decode", (0,), False, 0),
        ("decode", (1,), True, 0),
    ]
    ends = [r.ends_before for r in resumed]
    assert ends == sorted(ends, reverse=True) and ends[-1] == 0.0
    store = RunStore(tmp_path / "store", run.run_key)
    assert store.records.computed("resumed") == {"decode": {"0-1"}}
    again = stage_tasks.denoise_decode.fn(run, spec, 0, 0, "again", "0-1")
    assert not any(r.computed for r in again) and store.records.computed("again") == {}


def test_tile_failing_once_is_retried(
    prefect_server: str,
    tiny_bundle_path: Path,
    clip_1f: Path,
    reference: bytes,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tasks.stage_tasks as stage_tasks
    from k6vsr_core.model import stages

    plain, failed = stages.decode_tile, []

    def flaky(bundle, latent, depth=8):
        if not failed:
            failed.append(True)
            raise RuntimeError("transient device error")
        return plain(bundle, latent, depth)

    monkeypatch.setattr(stages, "decode_tile", flaky)
    monkeypatch.setattr(stage_tasks.decode, "retry_delay_seconds", 0)
    summary = _run(clip_1f, tmp_path / "a.mp4", tiny_bundle_path, tmp_path / "store")
    assert failed == [True]
    assert summary.tiles_computed == summary.tiles_total
    assert (tmp_path / "a.mp4").read_bytes() == reference


def test_truncated_tile_chunk_is_detected_and_recomputed(
    prefect_server: str, tiny_bundle_path: Path, clip_1f: Path, reference: bytes, tmp_path: Path
) -> None:
    first = _run(clip_1f, tmp_path / "a.mp4", tiny_bundle_path, tmp_path / "store")
    store = RunStore(tmp_path / "store", first.run_key)
    # A finished run's intermediates are gone: emulate one that stopped after tile 3's denoise, with tile 3's
    # latent chunk torn on disk, by putting back what such a run would have stored.
    manifest = store.read_manifest()
    plan = manifest.plan
    from k6vsr_core.model import stages
    from k6vsr_core.model.bundle import load_bundle
    from k6vsr_core.model.runner import read_source, read_window

    bundle = load_bundle(str(tiny_bundle_path))
    clip = read_source(clip_1f, plan.params, model_traits(bundle.info))
    latent = stages.encode_clip(
        bundle, stages.prepare_window(read_window(clip, plan.windows[0]), plan, plan.windows[0])
    )
    store.put_tile("latent", (0,), (1,), latent.numpy(), stage="encode")
    for chunk in plan.chunks:
        lr = stages.cut_tiles(latent, plan, chunk.tiles)
        for tile, value in zip(chunk.tiles, stages.denoise_chunk(bundle, lr, chunk, plan), strict=True):
            store.put_tile("tile_latents", (0, tile), (1, plan.num_tiles), value.numpy(), stage="denoise")
            if tile != 3:
                pixels = stages.decode_tile(bundle, value).numpy()
                store.put_tile("tiles", (0, tile), (1, plan.num_tiles), pixels, stage="decode")
    torn = next(p for p in (store.path / "data.zarr" / "tile_latents" / "c" / "0" / "3").rglob("*") if p.is_file())
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    for stage, item in (("decode", "0-3"), ("blend", "0"), ("segment", "0"), ("mux", "all")):
        store.records.drop(stage, item)
    again = _run(clip_1f, tmp_path / "b.mp4", tiny_bundle_path, tmp_path / "store")
    assert (again.tiles_computed, again.dit_calls) == (1, 2)
    # Per stage, what ran: tile 3's denoise and decode and the window's own stages; the rest was found stored.
    assert {stage: (c.computed, c.reused) for stage, c in again.items.items()} == {
        "ingest": (0, 1),
        "encode": (0, 1),
        "denoise": (1, 5),
        "decode": (1, 5),
        "blend": (1, 0),
        "segment": (1, 0),
        "mux": (1, 0),
    }
    line = summary_lines(again.model_dump(mode="json"))[3]
    assert line.startswith("items by stage: ingest: 0 computed, 1 reused; encode: 0 computed, 1 reused; denoise: ")
    assert "; decode: 1 computed, 5 reused; blend: 1 computed, 0 reused;" in line
    assert (tmp_path / "b.mp4").read_bytes() == reference


def test_plan_command_loads_no_model(tiny_bundle_path: Path, clip_1f: Path, tmp_path: Path, capsys) -> None:
    from entrypoints.cli import main
    from tasks import model_cache

    model_cache.clear()
    code = main(
        ["plan", str(clip_1f), "--scale", "2", "--model", str(tiny_bundle_path), "--store", str(tmp_path), "--json"]
    )
    plan = json.loads(capsys.readouterr().out)
    assert code == 0 and model_cache.cache_info().loaded == []
    assert plan["tiles"] == 6 and plan["frames_kept"] == 1 and plan["fps"] == 24
    assert plan["chunks"][1] == {"tiles": [1], "seed": 43}
    assert plan["output_size"] == {"width": 256, "height": 192}
    assert plan["finished_run_exists"] is False


def test_unready_dask_workers_fail_the_run_instead_of_hanging(
    prefect_server: str, tiny_bundle_path: Path, clip_1f: Path, tmp_path: Path
) -> None:
    """A worker that never runs a task (here: no time to start) ends the run with a clear error."""
    env = {**os.environ, "K6VSR_WORKERS_READY_TIMEOUT": "0.001"}
    argv = [
        "upscale",
        str(clip_1f),
        "-o",
        str(tmp_path),
        "--scale",
        "2",
        "--model",
        str(tiny_bundle_path),
        "--store",
        str(tmp_path / "store"),
        "--workers",
        "2",
        "--json",
    ]
    done = procs.run([sys.executable, "-m", "entrypoints.cli", *argv], env=env)
    assert done.returncode == 1
    assert "no Dask worker ran a trivial k6vsr task" in done.stderr
    assert not list(tmp_path.glob("*.mp4"))


@pytest.mark.slow
def test_default_command_prints_a_bar_warnings_and_six_lines(tiny_bundle_path: Path, tmp_path: Path) -> None:
    """The real command without a configured Prefect API: it starts the local server (analytics off, so no telemetry
    errors offline), and prints warnings, one line each, and a six-line summary; the task lines go to the run's log."""
    from k6vsr_core.media.sample import make_sample_clip
    from runtime.prefect_server import stop_server

    clip = make_sample_clip(tmp_path / "slow.mp4", width=64, height=64, num_frames=1, fps=12)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    server_home = tmp_path / "server"
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect"),
        K6VSR_SERVER_HOME=str(server_home),
        K6VSR_SERVER_PORT="0",
        K6VSR_SERVER_START_TIMEOUT="300",
    )
    argv = [
        "upscale",
        str(clip),
        "-o",
        str(tmp_path / "out"),
        "--scale",
        "2",
        "--model",
        str(tiny_bundle_path),
        "--store",
        str(tmp_path / "store"),
    ]
    try:
        done = procs.run([sys.executable, "-m", "entrypoints.cli", *argv], env=env, timeout=600)
    finally:
        stop_server(server_home)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.splitlines() == [
        "k6vsr: warning: source frame rate 12 fps is below 24 fps; keeping every frame at 12 fps (no motion "
        "interpolation is done)"
    ]
    lines = done.stdout.splitlines()
    assert len(lines) == 6, done.stdout
    assert lines[0].startswith(f"wrote {tmp_path / 'out'}") and lines[0].endswith("(128x128, 1 frame at 12 fps)")
    assert lines[1].endswith("1 of 1 tiles computed, 0 reused, 2 DiT calls")
    stage_time = r"\w+ \d+\.\d \(\d+\.\d\)"  # wall-clock span (busy seconds)
    assert re.fullmatch(rf"seconds by stage, wall clock \(busy\): ingest .*?(, {stage_time})+", lines[2]), lines[2]
    assert (
        lines[3].startswith("items by stage: ingest: 1 computed, 0 reused; ")
        and "decode: 1 computed, 0 reused" in lines[3]
    )
    log = Path(lines[5].removeprefix("log: "))
    assert lines[4] == f"store: {log.parent}"
    logged = log.read_text()
    assert "Task run 'denoise-decode-window-0-tiles-0' - Finished in state Completed()" in logged
    assert "Flow run 'upscale-slow.mp4'" in logged
