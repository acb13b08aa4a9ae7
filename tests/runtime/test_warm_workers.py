"""Warm workers: started once, used by every run, kept across runs and models, surviving a worker killed mid-tile.

One cluster of two CPU workers serves the whole module (starting one costs seconds); it is always stopped at the end.
Every run must give the bytes of the in-memory runner, whichever worker ran which tile.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import procs
import pytest

from k6vsr_core import UpscaleParams, upscale
from k6vsr_core.errors import ParameterError
from k6vsr_core.model.bundle import ModelBundle
from k6vsr_core.model.tiny_bundle import make_tiny_bundle
from service.runs import ModelSpec, prepare_run
from storage import RunStore

ROOT = Path(__file__).resolve().parents[2]

PARAMS = UpscaleParams(scale=2)


@pytest.fixture(scope="module")
def flow_reference(flow_bundle: ModelBundle, clip_1f: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    out = tmp_path_factory.mktemp("reference") / "flow.mp4"
    upscale(clip_1f, out, flow_bundle, PARAMS)
    return out.read_bytes()


@pytest.fixture(scope="module")
def cluster(prefect_server: str, tmp_path_factory: pytest.TempPathFactory):
    """Two warm CPU workers, started the way `k6vsr workers start -n 2` starts them, stopped at the end.

    They are started without PREFECT_API_URL, as from a fresh shell: each run hands its API to its tasks.
    """
    from runtime import warm_workers

    home = Path(os.environ["K6VSR_WORKERS_HOME"])
    saved = os.environ.pop("PREFECT_API_URL")
    try:
        record = warm_workers.start_workers(2, home=home)
    finally:
        os.environ["PREFECT_API_URL"] = saved
    try:
        yield record
    finally:
        warm_workers.stop_workers(home)


def _infos(address: str) -> dict[str, dict]:
    """Each worker's model cache, by worker name."""
    from distributed import Client

    from tasks.model_cache import cache_info

    with Client(address, timeout=10, set_as_default=False) as client:
        names = {addr: info["name"] for addr, info in client.scheduler_info(n_workers=-1)["workers"].items()}
        return {names[addr]: info for addr, info in client.run(lambda: cache_info().model_dump()).items()}


def _run(clip: Path, out: Path, bundle_path: Path, store: Path):
    from flows.orchestrate import run_clip

    model = ModelSpec(model=str(bundle_path), device="cpu")
    return run_clip(prepare_run(clip, PARAMS, model, store), str(out), model).summary()


def test_start_is_idempotent_and_status_names_each_worker(cluster, capsys) -> None:
    from entrypoints.cli import main
    from runtime import warm_workers

    assert warm_workers.start_workers(2).pid == cluster.pid  # a second start finds the running workers
    assert main(["workers", "status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["running"] and status["address"] == cluster.address and status["pid"] == cluster.pid
    assert sorted(w["name"] for w in status["workers"]) == ["cpu-0", "cpu-1"]
    assert all(w["models"] == [] and w["pid"] for w in status["workers"])
    # Whatever runs tiles without asking for a cluster (upscale, archive, serve's jobs) finds them; an explicit
    # request or K6VSR_WARM_WORKERS=off does not.
    from runtime.runners import resolve_address

    assert resolve_address(1, False, None) == cluster.address
    assert resolve_address(2, False, None) is None and resolve_address(1, False, "tcp://h:1") == "tcp://h:1"
    os.environ["K6VSR_WARM_WORKERS"] = "off"
    try:
        assert resolve_address(1, False, None) is None
    finally:
        del os.environ["K6VSR_WARM_WORKERS"]
    # The nanny's one-thread defaults are replaced by each worker's share of the cores.
    from distributed import Client

    with Client(cluster.address, timeout=10, set_as_default=False) as client:
        envs = client.run(lambda: {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_")})
    # The supervisor's share of the cores it may use; the nanny's malloc default is gone (a value the launching
    # environment itself sets is the user's, and is kept).
    cores = str(max(1, len(os.sched_getaffinity(cluster.pid)) // 2))
    inherited = os.environ.get("MALLOC_TRIM_THRESHOLD_")
    assert all(
        env["OMP_NUM_THREADS"] == cores and env["MALLOC_TRIM_THRESHOLD_"] == inherited for env in envs.values()
    ), (envs, cores, inherited)


def test_runs_use_the_warm_workers_and_keep_the_model(
    cluster, tiny_bundle_path: Path, clip_1f: Path, reference: bytes, tmp_path: Path
) -> None:
    from flows.orchestrate import upscale_request
    from tasks import model_cache

    model_cache.clear()
    summary = _run(clip_1f, tmp_path / "a.mp4", tiny_bundle_path, tmp_path / "store-a")
    assert summary.tiles_computed == summary.tiles_total
    assert f"tiles run on the warm workers at {cluster.address}" in Path(summary.log).read_text()
    assert (tmp_path / "a.mp4").read_bytes() == reference
    first = _infos(cluster.address)
    assert any(info["loads"] for info in first.values())  # the tiles ran there,
    assert model_cache.cache_info().loaded == []  # not in this process

    # Another run (another store, so every tile is computed again), as a deployment starts it: the flow called as
    # it is, with its default runner, which finds the warm workers too. Same processes, nothing loaded again.
    model = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    again = upscale_request(
        source=str(clip_1f), output=str(tmp_path / "b.mp4"), params=PARAMS, model=model, store_root=str(tmp_path)
    )
    assert again.tiles_computed == again.tiles_total
    assert (tmp_path / "b.mp4").read_bytes() == reference
    assert model_cache.cache_info().loaded == []
    second = _infos(cluster.address)
    assert {name: info["pid"] for name, info in second.items()} == {n: i["pid"] for n, i in first.items()}
    assert all(len(info["loads"]) <= 1 for info in second.values())  # each worker loaded the model once


def test_a_model_switch_loads_the_other_model(
    cluster, flow_bundle_path: Path, tiny_bundle_path: Path, clip_1f: Path, flow_reference: bytes, tmp_path: Path
) -> None:
    _run(clip_1f, tmp_path / "flow.mp4", flow_bundle_path, tmp_path / "store")
    assert (tmp_path / "flow.mp4").read_bytes() == flow_reference
    infos = _infos(cluster.address)
    assert any(str(flow_bundle_path) in " ".join(info["loaded"]) for info in infos.values())
    # Two models fit the cache: the first one is still there for the next run that wants it.
    assert all(len(info["loaded"]) <= 2 for info in infos.values())
    assert any(str(tiny_bundle_path) in " ".join(info["loaded"]) for info in infos.values())


def test_relative_paths_leave_the_command_absolute_for_the_warm_workers(
    cluster, tiny_bundle_path: Path, clip_1f: Path, reference: bytes, tmp_path: Path, monkeypatch, capsys
) -> None:
    """The workers run in their own folder, where a relative `--model` (or store, or source) would name nothing."""
    from entrypoints.cli import main
    from tasks import model_cache

    work = tmp_path / "work"
    shutil.copytree(tiny_bundle_path, work / "model")
    shutil.copyfile(clip_1f, work / "clip.mp4")
    monkeypatch.chdir(work)
    model_cache.clear()
    capsys.readouterr()
    argv = ["upscale", "clip.mp4", "--scale", "2", "--model", "model", "--device", "cpu", "--store", "store"]
    rc = main([*argv, "-o", "out", "--output-file-name", "out.mp4", "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    summary = json.loads(captured.out)
    assert summary["tiles_computed"] == summary["tiles_total"] and summary["store"].startswith(str(work / "store"))
    assert (work / "out" / "out.mp4").read_bytes() == reference
    assert model_cache.cache_info().loaded == []  # the tiles ran on the workers, with the model named absolutely
    assert any(str(work / "model") in " ".join(info["loaded"]) for info in _infos(cluster.address).values())


def test_the_command_imports_no_torch_with_warm_workers(
    cluster, tiny_bundle_path: Path, clip_1f: Path, reference: bytes, tmp_path: Path
) -> None:
    """`k6vsr upscale` served by warm workers plans, ingests, submits, muxes and publishes without torch or diffusers:
    the workers hold the model. Prints the seconds from the command's start to its first task (ingest)."""
    import sys

    import procs

    tests = Path(__file__).resolve().parents[1]
    report = tmp_path / "imports.json"
    argv = [str(clip_1f), "--scale", "2", "--model", str(tiny_bundle_path), "--device", "cpu"]
    argv += ["--store", str(tmp_path / "store"), "-o", str(tmp_path), "--output-file-name", "out.mp4", "--json"]
    env = {**os.environ, "PYTHONPATH": str(tests.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    started = time.time()
    done = procs.run(
        [sys.executable, str(tests / "import_audit.py"), str(report), "entrypoints.cli", "upscale", *argv], env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    audit = json.loads(report.read_text())
    assert audit["imported"] == [], "\n".join(audit["stacks"].values())
    assert (tmp_path / "out.mp4").read_bytes() == reference
    summary = json.loads(done.stdout)
    assert summary["tiles_computed"] == summary["tiles_total"]
    ingest = RunStore(tmp_path / "store", summary["run_key"]).records.read("ingest", "all")
    assert ingest is not None
    print(f"command start to its first task (ingest): {ingest.written_at - ingest.seconds - started:.2f} s")


def test_the_http_servers_job_process_imports_no_torch_with_warm_workers(
    cluster, tiny_bundle_path: Path, clip_1f: Path, reference: bytes, tmp_path: Path
) -> None:
    """The HTTP server's job process, as the server starts it (`python -m entrypoints.server.child SPEC PARENT`),
    serves a job through warm workers without torch or diffusers, and its output is the reference's bytes."""
    import sys

    import procs

    tests = Path(__file__).resolve().parents[1]
    report = tmp_path / "imports.json"
    spec = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    job = {
        "id": "job-1",
        "source": str(clip_1f),
        "output": str(tmp_path / "out.mp4"),
        "params": PARAMS.model_dump(mode="json"),
        "store_root": str(tmp_path / "store"),
        "latent_fps": None,
    }
    env = {**os.environ, "PYTHONPATH": str(tests.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    argv = [sys.executable, str(tests / "import_audit.py"), str(report), "entrypoints.server.child"]
    done = procs.run([*argv, spec.model_dump_json(), str(os.getpid())], env=env, input=json.dumps(job) + "\n")
    assert done.returncode == 0, done.stderr[-3000:]
    replies = [json.loads(line) for line in done.stdout.splitlines()]
    assert [reply["event"] for reply in replies] == ["ready", "done"], replies
    audit = json.loads(report.read_text())
    assert audit["imported"] == [], "\n".join(audit["stacks"].values())
    assert (tmp_path / "out.mp4").read_bytes() == reference


def test_weights_that_do_not_match_fail_on_the_warm_workers_before_any_tile(
    cluster, tiny_bundle_path: Path, clip_1f: Path, tmp_path: Path
) -> None:
    """The client of warm workers leaves the weights check to them: a bad model fails the run with its own error."""
    from safetensors.numpy import load_file, save_file

    from flows.orchestrate import run_clip
    from k6vsr_core.errors import BundleError
    from k6vsr_core.model.bundle import WEIGHTS

    bundle = shutil.copytree(tiny_bundle_path, tmp_path / "model")
    weights = bundle / "vae" / WEIGHTS
    state = load_file(str(weights))
    del state[sorted(state)[-1]]
    save_file(state, str(weights))
    model = ModelSpec(model=str(bundle), device="cpu")
    prepared = prepare_run(clip_1f, PARAMS, model, tmp_path / "store", tensors=False)
    with pytest.raises(BundleError, match=r"^vae: weights do not match the architecture"):
        run_clip(prepared, str(tmp_path / "out.mp4"), model).summary()
    store = RunStore(prepared.run.store_root, prepared.run.run_key)
    assert not store.tile_done("latent", (0,), stage="encode") and not (tmp_path / "out.mp4").exists()


def test_a_worker_killed_mid_tile_leaves_the_same_bytes(
    cluster, tiny_bundle_path: Path, clip_1f: Path, reference: bytes, tmp_path: Path
) -> None:
    """SIGKILL the worker that starts denoising the first chunk; the nanny replaces it and Dask reruns the tile."""
    from distributed import Client

    state = tmp_path / "faults"
    state.mkdir()
    tests = str(Path(__file__).resolve().parents[1])

    def arm() -> int:
        import sys

        sys.path.insert(0, tests)
        import fault_harness

        os.environ[fault_harness.ENV_STATE] = str(state)
        fault_harness.install(["kill@denoise:times=1"])
        return os.getpid()

    with Client(cluster.address, timeout=10, set_as_default=False) as client:
        armed = set(client.run(arm).values())  # the model workers and the CPU-lane workers
    summary = _run(clip_1f, tmp_path / "a.mp4", tiny_bundle_path, tmp_path / "store")
    assert (tmp_path / "a.mp4").read_bytes() == reference
    assert summary.tiles_computed == summary.tiles_total
    killed = [int(p.read_text().split()[0]) for p in state.glob("fired-*")]
    assert len(killed) == 1 and killed[0] in armed
    deadline = time.monotonic() + 90  # a fresh worker imports torch and prefect first
    while time.monotonic() < deadline and len({i["pid"] for i in _infos(cluster.address).values()} - armed) < 1:
        time.sleep(0.5)
    pids = {info["pid"] for info in _infos(cluster.address).values()}
    assert killed[0] not in pids and len(pids) == len(armed)  # the nanny started a fresh worker in its place


def test_model_cache_evicts_and_frees_the_least_recently_used(tmp_path: Path, monkeypatch) -> None:
    import gc
    import weakref

    from tasks import model_cache

    other = make_tiny_bundle(tmp_path / "other", seed=7)
    first = make_tiny_bundle(tmp_path / "first", seed=3)
    monkeypatch.setenv(model_cache.SIZE_ENV, "1")
    model_cache.clear()
    before = len(model_cache.cache_info().loads)  # loads of earlier tests in this process
    try:
        a = ModelSpec(model=str(first), device="cpu")
        b = ModelSpec(model=str(other), device="cpu")
        kept = weakref.ref(model_cache.get_bundle(a).transformer)
        assert model_cache.get_bundle(a).transformer is kept()  # a hit loads nothing
        model_cache.get_bundle(b)
        gc.collect()
        assert kept() is None  # the evicted model's weights are gone
        info = model_cache.cache_info()
        assert len(info.loaded) == 1 and str(other) in info.loaded[0] and len(info.loads) - before == 2
        assert info.loaded[0] == f"{other} on cpu"  # a local folder has no revision: nothing after its path
    finally:
        model_cache.clear()


@pytest.mark.timed
def test_stop_leaves_no_process_and_a_stale_record_is_ignored(cluster, tmp_path: Path, capsys) -> None:
    from entrypoints.cli import main
    from runtime import warm_workers
    from storage.processes import group_alive

    home = Path(os.environ["K6VSR_WORKERS_HOME"])
    # A supervisor that does not answer SIGTERM (frozen here; on a GPU, closing workers gracefully is slow) is
    # killed with its session after a short grace: a stop answers within seconds.
    os.kill(cluster.pid, signal.SIGSTOP)
    started = time.monotonic()
    assert main(["workers", "stop", "--json"]) == 0
    assert time.monotonic() - started < 5.0
    assert json.loads(capsys.readouterr().out)["stopped"] is True
    assert not group_alive(cluster.pid)  # nothing of the supervisor's session runs (init reaps the zombies later)
    assert warm_workers.running_address() is None
    # A record left by a supervisor that died is ignored, and removed.
    record = cluster.model_copy(update={"pid": 2**22 + 7, "process_start": 1})
    (home / "workers.json").write_text(record.model_dump_json())
    assert warm_workers.running_address() is None and not (home / "workers.json").exists()


def test_gpu_workers_are_pinned_without_dask_cuda(monkeypatch) -> None:
    """`--gpus` and `workers start --gpus`: one plain worker per GPU, its CUDA_VISIBLE_DEVICES naming it."""
    from runtime import runners, warm_workers

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    assert warm_workers.gpu_ids() == ["2", "5"]
    assert warm_workers._worker_env(["2", "5"], 1, 2)["CUDA_VISIBLE_DEVICES"] == "5"
    assert "CUDA_VISIBLE_DEVICES" not in warm_workers._worker_env([], 0, 2)
    path, kwargs = runners.cluster_spec(1, gpus=True)
    assert path == "runtime.warm_workers.gpu_cluster" and kwargs == {"n_workers": 0}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ParameterError, match="--gpus: no GPU found"):
        warm_workers.gpu_cluster()


def test_a_dask_runner_is_told_by_its_class() -> None:
    """Not by its class's name: a subclass of prefect-dask's runner is one, a thread pool is not."""
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner

    from runtime.runners import is_dask_runner

    class OurDaskRunner(DaskTaskRunner):
        pass

    assert is_dask_runner(DaskTaskRunner()) and is_dask_runner(OurDaskRunner())
    assert not is_dask_runner(ThreadPoolTaskRunner()) and not is_dask_runner(None)


def test_a_preload_for_the_resolved_device_serves_auto_without_a_second_load(tmp_path: Path) -> None:
    """`workers start --device cpu` then a command's default `--device auto`: one load, not a copy per spelling."""
    from tasks import model_cache

    bundle = make_tiny_bundle(tmp_path / "tiny", seed=5)
    model_cache.clear()
    before = len(model_cache.cache_info().loads)
    try:
        preloaded = model_cache.get_bundle(ModelSpec(model=str(bundle), device=model_cache.resolve_device("auto")))
        assert model_cache.get_bundle(ModelSpec(model=str(bundle), device="auto")) is preloaded
        assert len(model_cache.cache_info().loads) - before == 1
    finally:
        model_cache.clear()


def test_a_cpu_worker_logs_no_flex_attention_advice(tiny_bundle_path: Path) -> None:
    """Eager flex attention is the CPU's NABLA by design: torch's advice to compile it stays out of workers.log."""
    code = (
        "import torch\n"
        "from torch.nn.attention.flex_attention import flex_attention\n"
        "from service.runs import ModelSpec\n"
        "from tasks import model_cache\n"
        f"model_cache.get_bundle(ModelSpec(model={str(tiny_bundle_path)!r}, device='cpu'))\n"
        "q = torch.randn(1, 1, 128, 16)\n"
        "flex_attention(q, q, q)\n"
        "print('attended')\n"
    )
    done = procs.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert done.returncode == 0 and "attended" in done.stdout, done.stderr[-3000:]
    assert "flex_attention called without torch.compile" not in done.stderr, done.stderr[-3000:]
