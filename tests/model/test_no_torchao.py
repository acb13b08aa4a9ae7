"""A bf16 run never imports torchao (only `precision=fp8` may): importing it changes Inductor's cache keys, so a
bf16 process with the `fp8` extra installed missed kernels compiled without it. And a library's own warning (as
torchao's SyntaxWarning on import) never reaches the terminal as a `k6vsr: warning:` line."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

from entrypoints import console

ROOT = Path(__file__).resolve().parents[2]
STUB = "def __getattr__(name):\n    return type(name, (), {})\n"
# What diffusers imports of torchao 0.16 at module level; everything else it asks for it finds missing.
MODULES = ("quantization", "prototype", "prototype/safetensors", "dtypes")
FILES = ("prototype/safetensors/safetensors_support.py", "prototype/safetensors/safetensors_utils.py", "utils.py")

# The command's imports, a bf16 load of the tiny bundle prepared as a worker prepares it, and the in-memory runner.
RUN = """
import sys, tempfile, torch
import entrypoints.cli, flows.upscale_clip, tasks.stage_tasks, tasks.model_cache
from k6vsr_core import upscale
from k6vsr_core.model.bundle import load_bundle
from k6vsr_core.model.tiny_bundle import make_tiny_bundle
from k6vsr_core.model.fast import compile_bundle
from k6vsr_core.media.sample import make_sample_clip
folder = tempfile.mkdtemp()
path = make_tiny_bundle(folder + "/tiny")
compile_bundle(load_bundle(str(path), dtype=torch.bfloat16))
clip = make_sample_clip(folder + "/clip.mp4", width=64, height=64, num_frames=1)
upscale(clip, folder + "/out.mp4", load_bundle(str(path)))
print("torchao" in sys.modules)
"""


def _fake_torchao(site: Path, marker: Path) -> None:
    """A torchao 0.16 that diffusers sees installed, and whose import writes `marker`."""
    package = site / "torchao"
    for name in ("", *MODULES):
        (package / name).mkdir(parents=True, exist_ok=True)
        (package / name / "__init__.py").write_text(STUB)
    for name in FILES:
        (package / name).write_text(STUB)
    (package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n{STUB}")
    info = site / "torchao-0.16.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchao\nVersion: 0.16.0\n")
    (info / "top_level.txt").write_text("torchao\n")
    (info / "RECORD").write_text("torchao/__init__.py,,\n")


def test_a_bf16_run_never_imports_torchao(tmp_path: Path) -> None:
    site, marker = tmp_path / "site", tmp_path / "torchao-imported"
    _fake_torchao(site, marker)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)]), "K6VSR_CPU_THREADS": "1"}
    env["K6VSR_COMPILE_CACHE"] = str(tmp_path / "cache")
    done = subprocess.run(
        [sys.executable, "-c", RUN], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
    assert not marker.exists()


def test_the_fake_torchao_is_seen_by_diffusers(tmp_path: Path) -> None:
    """The test above proves something: without k6vsr_core, diffusers imports this torchao."""
    site, marker = tmp_path / "site", tmp_path / "torchao-imported"
    _fake_torchao(site, marker)
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = "import diffusers.models.modeling_utils"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert marker.exists()


def _shown(source: str, filename: str, capsys) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = console._show_once
        compile(source, filename, "exec")
    return capsys.readouterr().err


def test_a_librarys_import_warning_stays_off_the_terminal(capsys) -> None:
    library = str(Path(sys.prefix) / "lib" / "site-packages" / "torchao" / "quantization" / "utils.py")
    assert _shown("pattern = '\\.x'\n", library, capsys) == ""


def test_k6vsr_s_own_warnings_reach_the_terminal(capsys) -> None:
    ours = str(ROOT / "k6vsr_core" / "plan.py")
    assert "k6vsr: warning: " in _shown("pattern = '\\d'\n", ours, capsys)
    from k6vsr_core.device.compile_cache import CompileNotice

    console._show_once(CompileNotice("compiling"), CompileNotice, "/elsewhere/torch/x.py", 1)
    assert capsys.readouterr().err == "k6vsr: warning: compiling\n"
