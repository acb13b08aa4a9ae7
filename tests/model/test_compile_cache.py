"""The compile cache on the CPU: the cold-compile notice once per new shape, and `k6vsr cache export`/`import` (or
`$K6VSR_COMPILE_ARTIFACTS`) carrying PyTorch's cache artefacts to a machine whose cache is empty, where the compile
then hits them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest

from k6vsr_core.device import compile_cache, process_env

# Compiles a small function with Inductor (C++ on the CPU) under the watch, as a stage would call a network.
COMPILE_ONCE = """
import json, sys, warnings
import torch
from torch._dynamo.utils import counters
from k6vsr_core.device import compile_cache
compile_cache.import_configured_artifacts()  # what compile_bundle does first: $K6VSR_COMPILE_ARTIFACTS, if set
root = compile_cache.compile_cache_dir()
compile_cache.enable_compile_cache(root)
watch = compile_cache.CompileWatch(root, {("DiT", None)}, "about 3 minutes")
f = torch.compile(lambda x: (x.sin() * 2).cumsum(0), dynamic=False)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with watch("DiT", (8,), "dense"):
        f(torch.ones(8))
inductor = counters["inductor"]
notices = [str(w.message) for w in caught if w.category is compile_cache.CompileNotice]
print(json.dumps({"hits": inductor["fxgraph_cache_hit"], "misses": inductor["fxgraph_cache_miss"], "notices": notices}))
"""


def _start_compile(
    cache: Path, tmp: Path, artifacts: Path | None = None, inductor: Path | None = None
) -> subprocess.Popen[str]:
    inductor = inductor or cache / "inductor"
    env = {**os.environ, process_env.COMPILE_CACHE_ENV: str(cache), "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    env.pop(compile_cache.ARTIFACTS_ENV, None)
    if artifacts is not None:
        env[compile_cache.ARTIFACTS_ENV] = str(artifacts)
    env["TMPDIR"] = str(tmp)  # Inductor's default temporary caches stay out of the way
    return subprocess.Popen(
        [sys.executable, "-c", COMPILE_ONCE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _compiled(process: subprocess.Popen[str]) -> dict:
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def _compile_in_fresh_process(cache: Path, tmp: Path, artifacts: Path | None = None) -> dict:
    return _compiled(_start_compile(cache, tmp, artifacts))


def _cli(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, process_env.COMPILE_CACHE_ENV: str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    return subprocess.run(
        [sys.executable, "-m", "entrypoints.cli", "cache", *args], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_exported_kernels_hit_in_an_empty_cache_after_import(tmp_path: Path) -> None:
    first, second = tmp_path / "machine-a", tmp_path / "machine-b"
    cold = _compile_in_fresh_process(first, tmp_path)
    assert cold["misses"] >= 1 and cold["hits"] == 0
    assert len(cold["notices"]) == 1 and "first run on this machine" in cold["notices"][0]

    warm = _compile_in_fresh_process(first, tmp_path)
    assert warm["hits"] >= 1 and warm["notices"] == []  # same machine: the shape is known, the kernels cached
    # The shape is known but this process's Inductor cache is another one: it compiles, and says so and why (started
    # now, it compiles while the cache is exported and imported below).
    (tmp_path / "tmp-a").mkdir()
    on_first_elsewhere = _start_compile(first, tmp_path / "tmp-a", inductor=tmp_path / "other-inductor")

    exported = _cli("export", str(tmp_path / "kernels.zip"), cache=first)
    assert exported.returncode == 0, exported.stderr
    with zipfile.ZipFile(tmp_path / "kernels.zip") as archive:
        manifest = json.loads(archive.read(compile_cache.ARCHIVE_MANIFEST))
    assert manifest["shapes"] and manifest["artifacts"]

    imported = _cli("import", str(tmp_path / "kernels.zip"), cache=second)
    assert imported.returncode == 0, imported.stderr
    # Two machines at once (separate caches): one imported by the command, and one by the setting deployments and
    # warm workers read, with which the process imports the file itself before compiling.
    (tmp_path / "tmp-b").mkdir(), (tmp_path / "tmp-c").mkdir()
    on_second = _start_compile(second, tmp_path / "tmp-b")
    on_third = _start_compile(tmp_path / "machine-c", tmp_path / "tmp-c", artifacts=tmp_path / "kernels.zip")
    after, configured = _compiled(on_second), _compiled(on_third)
    assert after["hits"] >= 1 and after["misses"] == 0
    assert after["notices"] == []
    assert configured["hits"] >= 1 and configured["misses"] == 0 and configured["notices"] == []
    elsewhere = _compiled(on_first_elsewhere)
    assert elsewhere["misses"] >= 1
    (notice,) = elsewhere["notices"]
    assert "although this machine ran this shape before" in notice and str(tmp_path / "other-inductor") in notice


def test_export_of_an_empty_cache_and_import_of_a_foreign_file_are_refused(tmp_path: Path) -> None:
    empty = _cli("export", str(tmp_path / "out.zip"), cache=tmp_path / "empty")
    assert empty.returncode == 2 and "no compiled kernels" in empty.stderr
    assert not (tmp_path / "out.zip").exists()

    (tmp_path / "junk.zip").write_bytes(b"not a zip")
    junk = _cli("import", str(tmp_path / "junk.zip"), cache=tmp_path / "c")
    assert junk.returncode == 2 and "not a k6vsr compile cache file" in junk.stderr

    foreign = tmp_path / "foreign.zip"
    manifest = compile_cache.CacheManifest(
        torch="0.0.1", cuda=None, triton=None, device=None, machine="x", shapes=[], artifacts=[], created_at=0
    )
    with zipfile.ZipFile(foreign, "w") as archive:
        archive.writestr(compile_cache.ARCHIVE_MANIFEST, manifest.model_dump_json())
    refused = _cli("import", str(foreign), cache=tmp_path / "c")
    assert refused.returncode == 2 and "compiled for another stack: torch 0.0.1" in refused.stderr


def test_the_watch_says_nothing_for_what_does_not_compile(tmp_path: Path) -> None:
    watch = compile_cache.CompileWatch(tmp_path, {("DiT", "nabla")}, "a few seconds")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watch("DiT", (1, 2), "dense"):
            pass
        with watch("KVAE decoder", (1, 2), "chunk 1"):
            pass
    assert caught == []
    assert compile_cache.known_shapes(tmp_path) == []


# Two threads call one compiled function at one shape under the watch, the second while the first compiles it: as
# a model thread's denoise comes while the command's warm-up thread compiles the DiT.
COMPILE_BESIDE = """
import json, threading, time, warnings
import torch
from torch._dynamo.utils import counters
from k6vsr_core.device import compile_cache
root = compile_cache.compile_cache_dir()
compile_cache.enable_compile_cache(root)
watch = compile_cache.CompileWatch(root, {("DiT", None)}, "about 3 minutes")
f = torch.compile(lambda x: (x.sin() * 2).cumsum(0), dynamic=False)
compiling = threading.Event()
unforeseen = []
def call(first):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if not first:
            compiling.wait()
            time.sleep(0.3)
        with watch("DiT", (8,), "dense"):
            if first:
                compiling.set()
            f(torch.ones(8))
    unforeseen.extend(str(w.message) for w in caught if "although" in str(w.message))
threads = [threading.Thread(target=call, args=(first,)) for first in (True, False)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps({"frames": counters["frames"]["ok"], "unforeseen": unforeseen}))
"""


def test_a_shape_called_while_another_thread_compiles_it_compiles_once(tmp_path: Path) -> None:
    env = {**os.environ, process_env.COMPILE_CACHE_ENV: str(tmp_path / "cache")}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    env["TMPDIR"] = str(tmp_path)
    env.pop(compile_cache.ARTIFACTS_ENV, None)
    done = subprocess.run([sys.executable, "-c", COMPILE_BESIDE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"frames": 1, "unforeseen": []}


def test_a_first_call_that_built_kernels_and_the_waits_for_it_are_compile_spans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `flows.preview` leaves out of a pace: a first call that built kernels, and another thread's wait for
    it; not a later call, nor a first call whose kernels all came from the cache."""
    import threading

    built = {"n": 0}
    monkeypatch.setattr(
        compile_cache.CompileCounts, "now", classmethod(lambda cls: cls(graphs=built["n"], built=built["n"], loaded=0))
    )
    monkeypatch.setattr(compile_cache, "save_process_artifacts", lambda root: None)
    compiling, waiting = threading.Event(), threading.Event()
    watch = compile_cache.CompileWatch(tmp_path, {("DiT", None)}, "about 3 minutes")
    spans: dict[str, list[tuple[float, float]]] = {}

    def first() -> None:
        with compile_cache.compile_spans() as mine, watch("DiT", (8,), "dense"):
            compiling.set()
            assert waiting.wait(30)
            built["n"] += 1
        spans["first"] = mine

    def second() -> None:
        assert compiling.wait(30)
        (ended,) = watch._first_ended.values()
        plain_wait = ended.wait

        def wait(timeout: float | None = None) -> bool:
            waiting.set()  # this call waits for the first one: that one may end now
            return plain_wait(timeout)

        ended.wait = wait  # type: ignore[method-assign]
        with compile_cache.compile_spans() as mine, watch("DiT", (8,), "dense"):
            pass
        spans["second"] = mine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", compile_cache.CompileNotice)
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        with compile_cache.compile_spans() as later, watch("DiT", (8,), "dense"):
            pass
        with compile_cache.compile_spans() as cached, watch("DiT", (16,), "dense"):
            pass  # graphs traced, none built: the cache held them
    assert len(spans["first"]) == 1 and spans["first"][0][0] <= spans["first"][0][1]
    assert len(spans["second"]) == 1 and spans["second"][0][1] >= spans["first"][0][1] - 1e-3
    assert later == [] and cached == []
