"""One process that only computes: an archive's model work in one process, its CPU work in processes of their own,
and the model lane never idle while anything is ready for it.

The archive runs at its defaults on the cluster a GPU machine's command starts for itself
(`runtime.warm_workers.split_cluster`, chosen here with K6VSR_LANES=processes since this machine has no GPU), with the
bench-only stand-in for the networks: each call holds the process's one "device" for a fixed time, as a GPU would
(`bench.fake_model`). What is asserted is where each item ran and how model items overlap, never a wall-clock
bound; the overlaps still need the machine to itself, so the archive's test is in the timed pass.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import fake_model
from k6vsr_core.contract.params import UpscaleParams
from k6vsr_core.media.sample import make_sample_clip
from service.runs import ModelSpec
from storage import RunStore
from tests.timelines import MODEL_STAGES, covered, lines_of, next_ready

STAND_IN_MS = 300.0
CPU_ITEMS = ("blend", "segment")


# The overlaps are of items a few hundred milliseconds long: a machine loaded several times over by other tests
# stretches the scheduler's round trips between them, so this one runs alone, in the timed pass.
@pytest.mark.timed
def test_an_archive_keeps_the_model_process_computing_and_its_cpu_work_apart(
    prefect_server: str, tiny_bundle_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.upscale_archive import upscale_archive

    monkeypatch.setenv("K6VSR_NETWORKS", fake_model.SPEC)
    monkeypatch.setenv("K6VSR_FAKE_MODEL_MS", f"{STAND_IN_MS:g}")
    monkeypatch.setenv("K6VSR_LANES", "processes")
    monkeypatch.setenv("K6VSR_WARM_WORKERS", "off")
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(3):  # two windows of four tiles each; its own tone, so a run of its own
        make_sample_clip(folder / f"c{i}.mp4", width=128, height=128, num_frames=122, tone_hz=300.0 + i)
    summary = upscale_archive(
        input_dir=str(folder),
        output_dir=str(tmp_path / "out"),
        params=UpscaleParams(scale=2),
        model=ModelSpec(model=str(tiny_bundle_path), device="cpu"),
        store_root=str(tmp_path / "store"),
    )
    assert summary.counts == {"done": 3}
    runs = [RunStore(str(tmp_path / "store"), row.run_key).path for row in summary.rows]
    lines = lines_of(runs)
    model = [line for line in lines if line["stage"] in MODEL_STAGES]
    cpu = [line for line in lines if line["stage"] in CPU_ITEMS]
    assert len(model) >= 3 * 2 * 3 and cpu

    # Where each item ran: every model item in one process, neither the command's nor a CPU item's.
    model_pids = {line["pid"] for line in model}
    cpu_pids = {line["pid"] for line in cpu}
    assert len(model_pids) == 1, model_pids
    assert not model_pids & cpu_pids and os.getpid() not in model_pids | cpu_pids

    # The model lane: the next item was under way whenever one ended (it waited for the device, not the device for
    # it), and some model item was running over nine tenths of the span from the first to the last.
    spans = [(line["start"], line["end"]) for line in model]
    span = max(e for _, e in spans) - min(s for s, _ in spans)
    assert next_ready(spans) >= 0.9
    assert covered(spans) >= 0.9 * span
    # CPU work overlapped model work: blends and segments ran while the model process computed.
    assert any(any(s < c["start"] < e for s, e in spans) for c in cpu)


@pytest.mark.parametrize(
    ("setting", "device", "own"),
    [("threads", "cuda", False), ("processes", "cpu", True), ("", "cpu", False), ("auto", "cpu", False)],
)
def test_where_a_command_s_tiles_compute(monkeypatch: pytest.MonkeyPatch, setting: str, device: str, own: bool) -> None:
    """`K6VSR_LANES`: a command's own split cluster where asked, never on `--device cpu` by default, and on a GPU
    machine (`auto`) only where a GPU is listed."""
    from runtime import runners

    monkeypatch.setenv("K6VSR_LANES", setting)
    assert runners.own_processes(device) is own


def test_auto_starts_a_split_cluster_where_a_gpu_is_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime import runners, warm_workers

    monkeypatch.setenv("K6VSR_LANES", "auto")
    monkeypatch.setattr(warm_workers, "gpu_ids", lambda: ["0"])
    assert runners.own_processes("auto") and runners.own_processes("cuda") and not runners.own_processes("cpu")
    assert not runners.own_processes("cuda:1")  # a device by number: the command's threads
    monkeypatch.setattr(warm_workers, "gpu_ids", lambda: [])
    assert not runners.own_processes("auto")


def test_an_unknown_lanes_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from k6vsr_core.errors import ParameterError
    from runtime import runners

    monkeypatch.setenv("K6VSR_LANES", "gpu")
    with pytest.raises(ParameterError, match="K6VSR_LANES='gpu' must be one of auto, processes, threads"):
        runners.own_processes("cuda")
