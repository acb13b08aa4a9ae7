"""The archive flow: a folder tree of tiny clips with a broken file and a finished output, against a real server."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import pytest

from k6vsr_core import media, upscale
from k6vsr_core.contract.params import UpscaleParams
from k6vsr_core.media.sample import make_sample_clip
from k6vsr_core.model.bundle import ModelBundle
from service.runs import ModelSpec
from storage import RunStore

PARAMS = UpscaleParams(scale=2)


def _tree(root: Path) -> Path:
    """in/a.mp4, in/sub/b.mp4, in/sub/deeper/c.mp4 (distinct sizes, so distinct runs), a broken .mp4, a text file
    and in/old/d.mp4; returns the input folder."""
    folder = root / "in"
    (folder / "sub" / "deeper").mkdir(parents=True)
    (folder / "old").mkdir()
    make_sample_clip(folder / "a.mp4", width=64, height=64, num_frames=1)
    make_sample_clip(folder / "sub" / "b.mp4", width=96, height=64, num_frames=1)
    make_sample_clip(folder / "sub" / "deeper" / "c.mp4", width=64, height=96, num_frames=1, audio=False)
    make_sample_clip(folder / "old" / "d.mp4", width=64, height=64, num_frames=1, tone_hz=220.0)
    (folder / "sub" / "broken.mp4").write_bytes(bytes(range(256)) * 16)
    (folder / "notes.txt").write_text("not a video")
    return folder


def _by_path(rows: list[dict]) -> dict[str, dict]:
    return {row["relative_path"]: row for row in rows}


def _model(bundle: Path) -> ModelSpec:
    return ModelSpec(model=str(bundle), device="cpu")


def test_archive_runs_reuses_and_reruns_nothing(
    prefect_server: str, tiny_bundle_path: Path, tmp_path: Path, plan_calls: list[int]
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )
    from prefect.client.schemas.sorting import ArtifactSort

    from flows.upscale_archive import archive_slug, upscale_archive

    folder = _tree(tmp_path)
    out = tmp_path / "out"
    finished = out / "old" / "d_sr2x.mp4"
    finished.parent.mkdir(parents=True)
    finished.write_bytes(b"an output made earlier")
    before = finished.stat().st_mtime_ns
    kwargs = dict(
        input_dir=str(folder),
        output_dir=str(out),
        params=PARAMS,
        model=_model(tiny_bundle_path),
        store_root=str(tmp_path / "store"),
        max_parallel=2,
    )

    state = upscale_archive(**kwargs, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary.counts == {"done": 3, "reused": 1, "skipped": 1}
    assert not summary.failed
    # One per readable clip: the archive plans each (a reused one for its run key); a clip's ingest plans it once
    # more with its scene cuts, looked for then rather than while every clip is planned.
    assert len(plan_calls) == 4 + 3
    rows = _by_path(json.loads(Path(summary.manifest_json).read_text())["rows"])
    assert sorted(rows) == ["a.mp4", "old/d.mp4", "sub/b.mp4", "sub/broken.mp4", "sub/deeper/c.mp4"]
    assert rows["sub/broken.mp4"]["status"] == "skipped"
    assert "broken.mp4" in rows["sub/broken.mp4"]["reason"] and rows["sub/broken.mp4"]["output"] == ""
    assert rows["old/d.mp4"]["status"] == "reused" and rows["old/d.mp4"]["reason"] == "output exists"
    assert finished.read_bytes() == b"an output made earlier" and finished.stat().st_mtime_ns == before
    for relative, size in (("a.mp4", (128, 128)), ("sub/b.mp4", (192, 128)), ("sub/deeper/c.mp4", (128, 192))):
        row = rows[relative]
        expected = out / Path(relative).parent / f"{Path(relative).stem}_sr2x.mp4"
        assert row["status"] == "done" and row["reason"] == "", row
        assert row["output"] == str(expected) and expected.is_file()
        probe = media.probe(expected)
        assert (probe.width, probe.height) == size
        assert row["tiles_computed"] == row["tiles"] > 0 and row["tiles_reused"] == 0
        assert row["frames"] == 1 and row["seconds"] > 0 and len(row["run_key"]) > 8
    with open(summary.manifest_csv, newline="") as handle:
        table = list(csv.DictReader(handle))
    assert {r["relative_path"]: r["status"] for r in table} == {k: v["status"] for k, v in rows.items()}
    assert list(table[0]) == [
        "source",
        "relative_path",
        "status",
        "reason",
        "run_key",
        "frames",
        "tiles",
        "tiles_computed",
        "tiles_reused",
        "seconds",
        "output",
    ]

    # The Prefect side: one clip flow run per pending clip, under the archive run, and the manifest table.
    with get_client(sync_client=True) as client:
        archive_run = client.read_flow_run(state.state_details.flow_run_id)
        assert archive_run.name == "archive-in"
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[archive_run.id]))
        )
        assert sorted(run.name for run in children) == [
            "upscale-a.mp4",
            "upscale-sub/b.mp4",
            "upscale-sub/deeper/c.mp4",
        ]
        assert all(run.state.is_completed() for run in children)
        slug = archive_slug(folder)

        def artifacts_of(run_id):
            return client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])),
                sort=ArtifactSort.CREATED_DESC,
            )

        # One progress and one manifest, updated in place: no stale versions listed under the run.
        artifacts = artifacts_of(archive_run.id)
        assert sorted((a.key, a.type) for a in artifacts) == [
            (f"archive-manifest-{slug}", "markdown"),
            (f"archive-progress-{slug}", "progress"),
        ]
        progress = next(a for a in artifacts if a.type == "progress")
        assert float(progress.data) == 100.0 and progress.description == "clips: 3 done, 0 failed, 0 left"
        table = next(a for a in artifacts if a.type == "markdown")
        assert table.description == "3 done, 1 reused, 1 skipped"
        for relative, row in rows.items():
            assert f"| {row['status']} |" in next(line for line in table.data.splitlines() if relative in line)
        # Each clip run owns its progress and report, and the manifest links to it.
        for child in children:
            assert f"/runs/flow-run/{child.id})" in table.data
            owned = artifacts_of(child.id)
            assert sorted(a.key.split("-")[0] for a in owned) == ["clip", "tiles"]
            assert all(a.task_run_id is None for a in owned)

    # A second run of the same archive: every output exists, nothing is computed, and it says so.
    outputs = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*.mp4")}
    again = upscale_archive(**kwargs)
    assert again.counts == {"reused": 4, "skipped": 1}
    assert again.message.startswith("nothing new to do")
    assert all(row.tiles_computed in (0, None) for row in again.rows)
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*.mp4")} == outputs

    # Another seed names the same outputs: they are kept, and every rerun says they came from another request.
    for _ in range(2):
        changed = upscale_archive(**{**kwargs, "params": UpscaleParams(scale=2, seed=7)}, plan_only=True)
        row = next(r for r in changed.rows if r.relative_path == "sub/b.mp4")
        assert row.status == "reused" and "parameters or model changed" in row.reason
        assert row.run_key == rows["sub/b.mp4"]["run_key"]
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*.mp4")} == outputs


def test_failed_clip_does_not_stop_the_others(
    prefect_server: str, tiny_bundle_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A clip whose flow fails is `failed` with the reason; the other clip is done; the command exits 1."""
    from prefect import task

    import tasks.ingest as ingest_tasks
    from entrypoints.cli import main

    folder = tmp_path / "in"
    folder.mkdir()
    make_sample_clip(folder / "good.mp4", width=64, height=64, num_frames=1, tone_hz=330.0)
    make_sample_clip(folder / "doomed.mp4", width=64, height=64, num_frames=1, tone_hz=550.0)
    original = ingest_tasks.ingest

    @task(name="ingest")
    def failing_ingest(prepared, *rest, **options):
        if Path(prepared.source).name == "doomed.mp4":
            raise RuntimeError("disk on fire")
        return original.fn(prepared, *rest, **options)

    monkeypatch.setattr(ingest_tasks, "ingest", failing_ingest)
    argv = [
        "archive",
        str(folder),
        "-o",
        str(tmp_path / "out"),
        "--model",
        str(tiny_bundle_path),
        "--device",
        "cpu",
        "--scale",
        "2",
        "--store",
        str(tmp_path / "store"),
        "--max-parallel",
        "2",
        "--json",
    ]
    assert main(argv) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["failed"] is True and result["counts"] == {"done": 1, "failed": 1}
    rows = _by_path(result["rows"])
    assert rows["doomed.mp4"]["status"] == "failed" and "disk on fire" in rows["doomed.mp4"]["reason"]
    assert rows["good.mp4"]["status"] == "done" and (tmp_path / "out" / "good_sr2x.mp4").is_file()
    assert not (tmp_path / "out" / "doomed_sr2x.mp4").exists()
    on_disk = _by_path(json.loads(Path(result["manifest_json"]).read_text())["rows"])
    assert on_disk["doomed.mp4"]["status"] == "failed"


def test_plan_writes_the_manifest_and_runs_nothing(
    prefect_server: str, tiny_bundle_path: Path, tmp_path: Path, capsys
) -> None:
    from entrypoints.cli import main

    folder = _tree(tmp_path)
    out = tmp_path / "out"
    (out / "old").mkdir(parents=True)
    (out / "old" / "d_sr2x.mp4").write_bytes(b"earlier")
    store = tmp_path / "store"
    argv = [
        "archive",
        str(folder),
        "-o",
        str(out),
        "--model",
        str(tiny_bundle_path),
        "--device",
        "cpu",
        "--scale",
        "2",
        "--store",
        str(store),
        "--plan",
        "--exclude",
        "sub/deeper/*",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "plan only, nothing run: " in printed and "k6vsr-archive-manifest.json" in printed
    assert printed.count("2 planned") == 1  # the counts, said once
    manifest = json.loads((out / "k6vsr-archive-manifest.json").read_text())
    assert manifest["plan_only"] is True
    statuses = {r["relative_path"]: r["status"] for r in manifest["rows"]}
    assert statuses == {"a.mp4": "planned", "sub/b.mp4": "planned", "old/d.mp4": "reused", "sub/broken.mp4": "skipped"}
    planned = _by_path(manifest["rows"])["sub/b.mp4"]
    assert planned["output"] == str(out / "sub" / "b_sr2x.mp4") and planned["tiles"] > 0 and planned["run_key"]
    assert (out / "k6vsr-archive-manifest.csv").is_file()
    assert sorted(p.name for p in out.rglob("*.mp4")) == ["d_sr2x.mp4"]
    assert not (store / "runs").exists()


def test_path_list_and_name_collisions(tmp_path: Path, tiny_bundle_path: Path) -> None:
    """A list file mirrors under the common folder; two sources with one output name: the second is skipped."""
    from flows.archive.planning import plan_clips
    from flows.archive.sources import find_sources, read_path_list

    folder = tmp_path / "in"
    folder.mkdir()
    make_sample_clip(folder / "x.mp4", width=64, height=64, num_frames=1)
    make_sample_clip(folder / "x.mov", width=64, height=64, num_frames=1, tone_hz=300.0)
    listing = tmp_path / "clips.txt"
    listing.write_text("# tonight\nin/x.mp4\n\nin/x.mov\n")
    assert read_path_list(listing) == [str(tmp_path / "in/x.mp4"), str(tmp_path / "in/x.mov")]
    base, sources = find_sources(str(listing), None, tmp_path / "out", ["*.mp4"], [])
    assert base == folder.resolve() and [s.name for s in sources] == ["x.mp4", "x.mov"]
    rows, plans = plan_clips(
        base, sources, tmp_path / "out", PARAMS, _model(tiny_bundle_path), str(tmp_path / "s"), False
    )
    assert [r.status for r in rows] == ["planned", "skipped"]
    assert "already the output of x.mp4" in rows[1].reason
    assert list(plans) == ["x.mp4"] and plans["x.mp4"].run.run_key == rows[0].run_key


def test_scan_rules(tmp_path: Path, capsys) -> None:
    """Globs match case-insensitively on the relative path or name; hidden entries and the output folder are left
    out; the input folder itself cannot be the output folder."""
    from entrypoints.cli import main
    from flows.archive.sources import VIDEO_GLOBS, scan_folder

    folder = tmp_path / "in"
    for name in (
        "A.MP4",
        "b.mov",
        "notes.txt",
        ".hidden.mp4",
        ".cache/c.mp4",
        "sr/a_sr2x.mp4",
        "keep/d.mkv",
        "proxies/e.mp4",
    ):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"x")
    found = scan_folder(folder, VIDEO_GLOBS, ["proxies/*"], skip=folder / "sr")
    assert [p.relative_to(folder).as_posix() for p in found] == ["A.MP4", "b.mov", "keep/d.mkv"]
    assert [p.name for p in scan_folder(folder, ["keep/*"], [], skip=None)] == ["d.mkv"]
    assert main(["archive", str(folder), "-o", str(folder), "--plan"]) == 2
    assert "is the input folder" in capsys.readouterr().err


def test_the_tiles_column_counts_every_window(prefect_server: str, tiny_bundle_path: Path, tmp_path: Path) -> None:
    """A clip longer than one window has that many times the tiles of one window to compute."""
    from entrypoints.cli import main

    folder = tmp_path / "in"
    folder.mkdir()
    make_sample_clip(folder / "long.mp4", width=64, height=64, num_frames=250, audio=False)  # three windows
    argv = ["archive", str(folder), "-o", str(tmp_path / "out"), "--model", str(tiny_bundle_path), "--scale", "2"]
    assert main([*argv, "--device", "cpu", "--store", str(tmp_path / "store"), "--plan", "--json"]) == 0
    (row,) = json.loads((tmp_path / "out" / "k6vsr-archive-manifest.json").read_text())["rows"]
    assert row["status"] == "planned" and row["tiles"] == 3  # one 64x64 tile a window, three windows


def test_the_next_clip_computes_while_the_one_before_is_finished(
    prefect_server: str,
    tiny_bundle: ModelBundle,
    tiny_bundle_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two clips at the default `max_parallel`, one model queue: the other clip's model work runs while the clip that
    is ahead writes its segment (the first segment written waits for the other clip's first decode, and would wait in
    vain were the other clip held back until the first is finished); each output is the in-memory runner's. Which
    clip goes first among ready items is `tests/contract/test_schedule.py`'s."""
    from flows.upscale_archive import upscale_archive
    from k6vsr_core.contract import segments
    from service.runs import prepare_run

    folder = tmp_path / "in"
    folder.mkdir()
    for name, tone in (("a.mp4", 440.0), ("b.mp4", 220.0)):
        make_sample_clip(folder / name, width=128, height=96, num_frames=1, tone_hz=tone)
    store = tmp_path / "store"
    model = _model(tiny_bundle_path)
    keys = [prepare_run(folder / f"{name}.mp4", PARAMS, model, store).run.run_key for name in "ab"]
    seen: list[bool] = []  # per segment written: whether the other clip had decoded a tile by then
    plain = segments.write_segment

    def write_segment(path, *args, **kwargs) -> None:  # noqa: ANN001 - the stage's own call
        other = RunStore(store, next(key for key in keys if key not in str(path)))
        deadline = time.monotonic() + 120
        while not (other.tile_recorded("decode", (0, 0)) or other.output_done()) and time.monotonic() < deadline:
            time.sleep(0.05)
        seen.append(other.tile_recorded("decode", (0, 0)))
        plain(path, *args, **kwargs)

    monkeypatch.setattr(segments, "write_segment", write_segment)
    summary = upscale_archive(
        input_dir=str(folder),
        output_dir=str(tmp_path / "out"),
        params=PARAMS,
        model=model,
        store_root=str(store),
    )
    assert summary.counts == {"done": 2}
    assert seen == [True, True]
    rows = _by_path(summary.model_dump()["rows"])
    assert [rows["a.mp4"]["run_key"], rows["b.mp4"]["run_key"]] == keys
    for name in ("a.mp4", "b.mp4"):
        reference = tmp_path / f"ref-{name}"
        upscale(folder / name, reference, tiny_bundle, PARAMS)
        assert Path(rows[name]["output"]).read_bytes() == reference.read_bytes()
