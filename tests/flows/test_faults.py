"""Faults: a killed command, a killed Dask worker, a tile that always fails, damaged chunks and records.

Every case ends with a rerun of the same command that completes and writes exactly the bytes of an uninterrupted
run, reusing what was finished. The kills are real SIGKILLs of the `k6vsr` process (through tests/fault_harness.py),
one per stage; the clip is 96x64, one frame, at x2: two tiles, so a kill can land between them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import fault_harness
import pytest

from entrypoints.cli import main
from k6vsr_core.media.sample import make_sample_clip
from storage import RunStore

pytestmark = pytest.mark.usefixtures("prefect_server")

NAME = "out.mp4"


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sample_clip(tmp_path_factory.mktemp("clip") / "two-tiles.mp4", width=96, height=64, num_frames=1)


@pytest.fixture(scope="module")
def argv(clip: Path, tiny_bundle_path: Path):
    def build(store: Path, out: Path, *extra: str) -> list[str]:
        return [
            "upscale", str(clip), "--scale", "2", "--model", str(tiny_bundle_path), "--device", "cpu",
            "--store", str(store), "-o", str(out), "--output-file-name", NAME, "--json", *extra,
        ]  # fmt: skip

    return build


def run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, dict[str, Any] | None, str]:
    capsys.readouterr()
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, (json.loads(captured.out) if rc == 0 else None), captured.err


@pytest.fixture(scope="module")
def baseline(argv, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One uninterrupted run: its output bytes, its summary and its finished store (copied by the damage tests)."""
    root = tmp_path_factory.mktemp("baseline")
    import contextlib
    import io

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(argv(root / "store", root / "out")) == 0
    summary = json.loads(stdout.getvalue())
    assert (summary["tiles_total"], summary["tiles_computed"]) == (2, 2)
    return {"bytes": (root / "out" / NAME).read_bytes(), "summary": summary, "store": root / "store"}


# ------------------------------------------------------------------------------------------------ SIGKILL per stage

KILLS = {
    # point: (what the store holds after the kill, the fewest tiles the rerun must reuse)
    "ingest": ("manifest, no frame index record", 0),
    "encode": ("the frame index, no latent", 0),
    "tile": ("one decoded tile (the other tile's latent may be done too)", 1),
    "blend": ("every tile, no window frames", 2),
    "segment": ("the window's frames and a temporary segment, no segment", 2),
    "mux": ("the segment and a temporary MP4, no output", 2),
    "publish": ("the finished output; half a copy in the output folder", 2),
}


@pytest.fixture(scope="module")
def killed(argv, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every kill, as real subprocesses (three at a time): the command dies with SIGKILL at that point."""
    cases = {}
    for point in KILLS:
        root = tmp_path_factory.mktemp(f"kill-{point}")
        cases[point] = {"store": root / "store", "out": root / "out"}
    commands = [
        fault_harness.command(*argv(case["store"], case["out"]), specs=(f"kill@{point}",))
        for point, case in cases.items()
    ]
    for case, done in zip(cases.values(), fault_harness.run_all(commands, parallel=3), strict=True):
        case["process"] = done
    return cases


def _run_dir(store: Path) -> Path:
    (run_dir,) = (store / "runs").iterdir()
    return run_dir


@pytest.mark.parametrize("point", list(KILLS))
def test_sigkill_in_stage_then_rerun_is_identical(
    point: str, killed, baseline, argv, capsys: pytest.CaptureFixture
) -> None:
    case = killed[point]
    process = case["process"]
    assert process.returncode == -signal.SIGKILL, process.stderr[-3000:]
    assert "fault_harness: SIGKILL in" in process.stderr
    assert not (case["out"] / NAME).exists(), "a killed run published an output"

    records = _run_dir(case["store"]) / "done"
    items = {stage.name: sorted(p.stem for p in stage.glob("*.json")) for stage in records.glob("*")}
    if point == "ingest":
        assert (_run_dir(case["store"]) / "manifest.json").is_file() and "all" not in items.get("ingest", [])
    elif point == "encode":
        assert "all" in items["ingest"] and "encode" not in items
    elif point == "tile":
        assert len(items["decode"]) == 1 and "blend" not in items
    elif point == "blend":
        assert len(items["decode"]) == 2 and "blend" not in items
    elif point == "segment":
        assert "blend" in items and "segment" not in items
        assert list(_run_dir(case["store"]).glob("segments/.part.*.mp4")), "the killed segment left no temporary file"
    elif point == "mux":
        assert "segment" in items and "mux" not in items
        assert list(_run_dir(case["store"]).glob(".part.*.mp4")), "the killed muxer left no temporary file"
    elif point == "publish":
        assert "mux" in items and fault_harness.leftovers(case["out"]), "the killed publish left no partial file"

    rc, summary, err = run(argv(case["store"], case["out"]), capsys)
    assert rc == 0, err[-3000:]
    assert (case["out"] / NAME).read_bytes() == baseline["bytes"]
    reused = summary["tiles_reused"]
    assert reused >= KILLS[point][1] and summary["tiles_computed"] == 2 - reused, summary
    if point in ("ingest", "encode"):
        assert reused == 0
    if point == "publish":
        assert summary["reused_output"] is True
    assert fault_harness.leftovers(case["store"], case["out"]) == [], "temporary files survived the rerun"


# ------------------------------------------------------------------------------------------------ a killed Dask worker


def test_dask_worker_killed_while_holding_a_tile(
    argv, baseline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`--workers 2`: the first worker to decode a tile dies by SIGKILL; Dask restarts it and reruns the task."""
    state = tmp_path / "faults"
    for key, value in fault_harness.child_environment(["kill@decode:times=1"], state).items():
        monkeypatch.setenv(key, value)
    rc, summary, err = run(argv(tmp_path / "store", tmp_path / "out", "--workers", "2"), capsys)
    assert rc == 0, err[-3000:]
    ((marker, pid),) = fault_harness.fired(state)
    assert pid != os.getpid(), "the fault fired in the flow's process, not in a worker"
    assert (tmp_path / "out" / NAME).read_bytes() == baseline["bytes"]
    assert summary["tiles_total"] == 2
    # A fresh store: every tile was computed in this run, even the one whose worker died.
    assert (summary["tiles_computed"], summary["tiles_reused"]) == (2, 0)
    assert fault_harness.leftovers(tmp_path / "store", tmp_path / "out") == []


# -------------------------------------------------------------------------------------------- a tile that always fails


@pytest.fixture(scope="module")
def failed_tile(argv, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run whose tile 1 raises on every attempt (its denoise chunk), in-process."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("failed-tile")
    store, out = root / "store", root / "out"
    stderr = io.StringIO()
    with fault_harness.faults("raise@denoise:tile=1") as (fault,), contextlib.redirect_stderr(stderr):
        rc = main(argv(store, out))
    messages = [line for line in stderr.getvalue().splitlines() if line.startswith("k6vsr: error:")]
    return {"rc": rc, "messages": messages, "attempts": fault.calls, "store": store, "out": out}


def test_tile_failing_every_attempt_fails_the_run_and_keeps_finished_tiles(
    failed_tile, argv, baseline, capsys: pytest.CaptureFixture
) -> None:
    store, out = failed_tile["store"], failed_tile["out"]
    assert failed_tile["rc"] == 1
    assert failed_tile["attempts"] == 3, "the failing tile was not tried three times (two retries)"
    (message,) = failed_tile["messages"]
    assert "TileFailure" in message and "1 of 2 tiles failed" in message and "(tile 1: " in message
    assert "tile 0" not in message and "rerun the same command to resume" in message
    assert not (out / NAME).exists() and fault_harness.leftovers(store, out) == []
    records = _run_dir(store) / "done"
    assert sorted(p.stem for p in (records / "decode").glob("*.json")) == ["0-0"], "tile 0 was not kept"
    assert sorted(p.stem for p in (records / "denoise").glob("*.json")) == ["0-0"]

    rc, summary, err = run(argv(store, out), capsys)
    assert rc == 0, err[-3000:]
    assert (summary["tiles_reused"], summary["tiles_computed"]) == (1, 1)
    assert (out / NAME).read_bytes() == baseline["bytes"]


def test_tile_failure_message_gives_the_cause(failed_tile) -> None:
    (message,) = failed_tile["messages"]
    assert "InjectedFault: injected fault in denoise of tiles [1]" in message


def test_a_failed_tile_is_one_line_on_the_terminal(argv, tmp_path: Path) -> None:
    """Prefect's lines for each failed attempt (with tracebacks) go to the UI and the run's log, not the terminal."""
    import procs

    command = fault_harness.command(*argv(tmp_path / "store", tmp_path / "out"), specs=("raise@denoise:tile=1",))
    done = procs.run(command)
    assert done.returncode == 1, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("k6vsr: error: TileFailure: ") and "(tile 1: InjectedFault: injected fault" in line


# ------------------------------------------------------------------------------------------------ damaged store


@pytest.fixture(scope="module")
def decoded(argv, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The store of a run killed right after decoding every tile: what a finished run no longer keeps."""
    root = tmp_path_factory.mktemp("decoded")
    (done,) = fault_harness.run_all([fault_harness.command(*argv(root / "store", root / "out"), specs=("kill@blend",))])
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    return root / "store"


def _unfinished_copy(decoded: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the store of a run that died after decoding every tile."""
    store = tmp_path / "store"
    shutil.copytree(decoded, store)
    return store, _run_dir(store)


def _chunk(run_dir: Path, array: str, tile: int) -> Path:
    chunks = [p for p in (run_dir / "data.zarr" / array / "c" / "0" / str(tile)).rglob("*") if p.is_file()]
    assert len(chunks) == 1, chunks
    return chunks[0]


@pytest.fixture
def stage_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many times each model stage runs in this process."""
    from k6vsr_core.model import stages

    calls = {"encode_clip": 0, "denoise_chunk": 0, "decode_tile": 0}
    for name in calls:
        original = getattr(stages, name)

        def counting(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(stages, name, counting)
    return calls


DAMAGE = {
    # name: (damage, model stage calls the rerun must make)
    "truncated-latent-chunk": ("truncate tile_latents chunk 0", {"denoise_chunk": 1, "decode_tile": 0}),
    "truncated-pixel-chunk": ("truncate tiles chunk 1", {"denoise_chunk": 0, "decode_tile": 1}),
    "flipped-pixel-byte": ("flip one byte of tiles chunk 0", {"denoise_chunk": 0, "decode_tile": 1}),
    "garbage-tile-record": ("garbage JSON in done/decode/0-1.json", {"denoise_chunk": 0, "decode_tile": 1}),
    "garbage-chunk-record": ("garbage JSON in done/denoise/0-0.json", {"denoise_chunk": 1, "decode_tile": 0}),
    "garbage-manifest": ("garbage manifest.json", {"encode_clip": 0, "denoise_chunk": 0, "decode_tile": 0}),
    "truncated-tile-record": ("truncate done/decode/0-1.json", {"denoise_chunk": 0, "decode_tile": 1}),
    "flipped-chunk-record": ("flip a bit of done/denoise/0-0.json", {"denoise_chunk": 1, "decode_tile": 0}),
    "missing-latent-record": (
        "encode record deleted and tile 0 latent truncated",
        {"encode_clip": 1, "denoise_chunk": 1},
    ),
}


def _damage(name: str, run_dir: Path) -> None:
    if name == "truncated-latent-chunk":
        chunk = _chunk(run_dir, "tile_latents", 0)
        chunk.write_bytes(chunk.read_bytes()[:100])
    elif name == "truncated-pixel-chunk":
        chunk = _chunk(run_dir, "tiles", 1)
        chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    elif name == "flipped-pixel-byte":
        chunk = _chunk(run_dir, "tiles", 0)
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0x40
        chunk.write_bytes(bytes(data))
    elif name == "garbage-tile-record":
        (run_dir / "done" / "decode" / "0-1.json").write_text('{"stage": "decode", "check')
    elif name == "garbage-chunk-record":
        (run_dir / "done" / "denoise" / "0-0.json").write_bytes(b"\x00\xff garbage")
    elif name == "truncated-tile-record":
        record = run_dir / "done" / "decode" / "0-1.json"
        record.write_bytes(record.read_bytes()[:40])
    elif name == "flipped-chunk-record":
        # A bit of a digit of its time: the record stays valid JSON, and only its seal tells.
        record = run_dir / "done" / "denoise" / "0-0.json"
        data = bytearray(record.read_bytes())
        digit = data.index(b'"written_at": ') + len(b'"written_at": ') + 1
        data[digit] ^= 0x01
        record.write_bytes(bytes(data))
        json.loads(data)
    elif name == "garbage-manifest":
        (run_dir / "manifest.json").write_text("{ not json")
    elif name == "missing-latent-record":
        (run_dir / "done" / "encode" / "0.json").unlink()
        chunk = _chunk(run_dir, "tile_latents", 0)
        chunk.write_bytes(b"")


# What the warning of each damage names (a chunk's folder, or a record's file); the manifest is not a checked item.
WARNED = {
    "truncated-latent-chunk": "data.zarr/tile_latents/c/0/0",
    "truncated-pixel-chunk": "data.zarr/tiles/c/0/1",
    "flipped-pixel-byte": "data.zarr/tiles/c/0/0",
    "garbage-tile-record": "done/decode/0-1.json",
    "garbage-chunk-record": "done/denoise/0-0.json",
    "truncated-tile-record": "done/decode/0-1.json",
    "flipped-chunk-record": "done/denoise/0-0.json",
    "missing-latent-record": "data.zarr/tile_latents/c/0/0",
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_damaged_store_is_detected_and_recomputed(
    name: str,
    baseline,
    decoded,
    argv,
    tmp_path: Path,
    stage_calls: dict[str, int],
    capsys: pytest.CaptureFixture,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, run_dir = _unfinished_copy(decoded, tmp_path)
    _damage(name, run_dir)
    out = tmp_path / "out"
    with caplog.at_level("WARNING", logger="k6vsr.store"):
        rc, summary, err = run(argv(store, out), capsys)
    assert rc == 0, err[-3000:]
    assert (out / NAME).read_bytes() == baseline["bytes"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "k6vsr.store"]
    for stage, count in DAMAGE[name][1].items():
        assert stage_calls[stage] == count, (stage, stage_calls, warnings)
    assert RunStore(store, run_dir.name).output_done()
    warnings = [r.getMessage() for r in caplog.records if r.name == "k6vsr.store"]
    if name in WARNED:
        assert any(str(run_dir / WARNED[name]) in w and "computing it again" in w for w in warnings), warnings
    else:
        assert warnings == []


def test_damaged_output_in_store_is_muxed_again(
    baseline, argv, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """A finished run whose stored MP4 no longer matches its record: muxed again, never published damaged."""
    store = tmp_path / "store"
    shutil.copytree(baseline["store"], store)
    output = _run_dir(store) / "output.mp4"
    data = bytearray(output.read_bytes())
    data[-10] ^= 0xFF
    output.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="k6vsr.store"):
        rc, summary, err = run(argv(store, tmp_path / "out"), capsys)
    assert rc == 0, err[-3000:]
    assert summary["tiles_computed"] == 0 and summary["reused_output"] is False
    assert any(f"{output}: mux all does not match its checksum" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "out" / NAME).read_bytes() == baseline["bytes"]


def test_a_command_given_no_state_folder_keeps_it_under_the_session_s_temporary_folder(tmp_path: Path) -> None:
    """The suite used to leave a `k6vsr-faults-*` folder in the system's temporary folder for each such command."""
    root = tmp_path / "states"
    root.mkdir()
    env = {**os.environ, fault_harness.ENV_STATE_ROOT: str(root)}
    done = subprocess.run(
        fault_harness.command("--help", specs=("kill@decode",)), env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert [p.name.startswith("k6vsr-faults-") for p in root.iterdir()] == [True]
