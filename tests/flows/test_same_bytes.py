"""Every way of running a clip gives the in-memory runner's bytes (`reference`, tests/conftest.py): `run_clip` on
this process's threads, on two Dask worker processes and on a split cluster of its own (a model process that only
computes, CPU-lane processes beside it: its model items in the one model process, its blends and segments in
others), the `k6vsr upscale` command, and the archive flow."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from k6vsr_core.contract.params import UpscaleParams
from k6vsr_core.contract.stage_names import MODEL_STAGES
from service.runs import ModelSpec, prepare_run
from storage import RunStore
from tests.timelines import lines_of

PARAMS = UpscaleParams(scale=2)


def _run_clip(clip: Path, out: Path, model: ModelSpec, store: Path, **where: int) -> Path:
    """Run the clip; its run's folder."""
    from flows.orchestrate import run_clip, tile_runner

    prepared = prepare_run(clip, PARAMS, model, store)
    summary = run_clip(prepared, str(out), model, tile_runner(model, prepared, **where)).summary()
    assert summary.tiles_computed == summary.tiles_total  # computed here, not found in the store
    return RunStore(prepared.run.store_root, prepared.run.run_key).path


def _split_cluster(clip: Path, out: Path, model: ModelSpec, store: Path) -> None:
    """Its model items in one process of their own, its blends and segments in others (K6VSR_LANES=processes)."""
    lines = lines_of([_run_clip(clip, out, model, store)])
    model_pids = {line["pid"] for line in lines if line["stage"] in MODEL_STAGES}
    cpu_pids = {line["pid"] for line in lines if line["stage"] in ("blend", "segment")}
    assert len(model_pids) == 1 and cpu_pids and not model_pids & cpu_pids
    assert os.getpid() not in model_pids | cpu_pids


def _command(clip: Path, out: Path, model: ModelSpec, store: Path) -> None:
    from entrypoints.cli import main

    argv = ["upscale", str(clip), "--scale", "2", "--model", model.model, "--device", "cpu", "--store", str(store)]
    assert main([*argv, "-o", str(out.parent), "--output-file-name", out.name, "--json"]) == 0


def _archive(clip: Path, out: Path, model: ModelSpec, store: Path) -> None:
    from flows.upscale_archive import upscale_archive

    folder = out.parent / "in"
    folder.mkdir()
    shutil.copyfile(clip, folder / clip.name)
    summary = upscale_archive(
        input_dir=str(folder), output_dir=str(out.parent / "out"), params=PARAMS, model=model, store_root=str(store)
    )
    (row,) = summary.rows
    assert row.status == "done", row.reason
    shutil.copyfile(row.output, out)


RUNNERS = {
    "threads": lambda clip, out, model, store: _run_clip(clip, out, model, store),
    "dask-workers": lambda clip, out, model, store: _run_clip(clip, out, model, store, workers=2),
    "split-cluster": _split_cluster,
    "command": _command,
    "archive": _archive,
}


@pytest.mark.parametrize("runner", RUNNERS)
def test_every_runner_gives_the_in_memory_runner_s_bytes(
    runner: str,
    prefect_server: str,
    tiny_bundle_path: Path,
    clip_1f: Path,
    reference: bytes,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("K6VSR_WARM_WORKERS", "off")
    monkeypatch.setenv("K6VSR_LANES", "processes" if runner == "split-cluster" else "threads")
    out = tmp_path / "out.mp4"
    RUNNERS[runner](clip_1f, out, ModelSpec(model=str(tiny_bundle_path), device="cpu"), tmp_path / "store")
    assert out.read_bytes() == reference
