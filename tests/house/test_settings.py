"""The settings registry: read when asked for, every bad value named, docs/settings.md's table made from it, and no
product module reading the environment as it is imported."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from k6vsr_core import settings
from k6vsr_core.settings import SettingsError

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("k6vsr_core", "storage", "tasks", "runtime", "flows", "entrypoints", "service")


def test_a_value_set_after_import_is_the_one_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("K6VSR_LEASE_SECONDS", raising=False)
    assert settings.read(settings.Store).lease_seconds == 300.0
    monkeypatch.setenv("K6VSR_LEASE_SECONDS", "12.5")
    assert settings.read(settings.Store).lease_seconds == 12.5
    monkeypatch.setenv("K6VSR_LEASE_SECONDS", "")  # empty is unset: how a parent clears a child's value
    assert settings.read(settings.Store).lease_seconds == 300.0


@pytest.mark.parametrize(
    ("group", "name", "value"),
    [
        (settings.Store, "K6VSR_LEASE_SECONDS", "soon"),
        (settings.Store, "K6VSR_BLEND_WAIT", "-1"),
        (settings.Server, "K6VSR_SERVER_PORT", "70000"),
        (settings.Workers, "K6VSR_LANES", "gpu"),
        (settings.Workers, "K6VSR_CPU_LANE_WORKERS", "0"),
        (settings.Workers, "K6VSR_WARM_WORKERS", "maybe"),
        (settings.Compute, "K6VSR_CPU_THREADS", "many"),
        (settings.Compute, "K6VSR_DECODER_LAYOUT", "nhwc"),
    ],
)
def test_a_bad_value_is_refused_naming_its_variable(
    group: type, name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=re.escape(f"{name}={value!r}")):
        settings.read(group)


def test_choices_are_read_in_any_case(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K6VSR_LANES", " Threads")
    monkeypatch.setenv("K6VSR_WARM_WORKERS", "OFF")
    workers = settings.read(settings.Workers)
    assert (workers.lanes, workers.warm_workers) == ("threads", False)


def test_a_child_s_environment_is_written_from_the_registry() -> None:
    assert settings.child_env(warm_model='{"model": "m"}', lanes=None) == {
        "K6VSR_WARM_MODEL": '{"model": "m"}',
        "K6VSR_LANES": "",
    }
    with pytest.raises(KeyError, match="warm_modle"):
        settings.child_env(warm_modle="x")


def test_the_docs_table_of_settings_is_the_registry_s() -> None:
    readme = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    table = readme.split("<!-- settings:start -->\n", 1)[1].split("\n<!-- settings:end -->", 1)[0]
    assert table == settings.settings_table()


def test_every_k6vsr_variable_the_product_names_is_in_the_registry() -> None:
    known = {settings.env_name(name) for group in settings.GROUPS for name in group.model_fields}
    named = set()
    for room in PRODUCT:
        for path in (ROOT / room).rglob("*.py"):
            named |= set(re.findall(r"\bK6VSR_[A-Z_]+[A-Z]\b", path.read_text(encoding="utf-8")))
    assert named <= known, sorted(named - known)


def _module_level_env_reads(path: Path) -> list[int]:
    """Lines of `os.environ` / `os.getenv` outside any function body."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            inside |= {id(child) for child in ast.walk(node)}
    lines = []
    for node in ast.walk(tree):
        if id(node) in inside or not isinstance(node, ast.Attribute):
            continue
        if isinstance(node.value, ast.Name) and node.value.id == "os" and node.attr in ("environ", "getenv"):
            lines.append(node.lineno)
    return lines


def test_no_module_reads_the_environment_at_module_level() -> None:
    found = {}
    for room in PRODUCT:
        for path in sorted((ROOT / room).rglob("*.py")):
            if lines := _module_level_env_reads(path):
                found[str(path.relative_to(ROOT))] = lines
    assert found == {}


# Importing every product module, with every setting read counted. `k6vsr_core` itself was imported before the
# count began: it sets torch's allocator and Inductor's cache folder as it is imported (`process_env`), since
# Inductor reads its folder once, as early as an import of flex attention.
_IMPORT_ALL = """
import importlib, json, pkgutil, sys, traceback
from k6vsr_core import settings
callers = []
real = settings.read
def counted(group):
    frame = sys._getframe(1)
    stack = "".join(traceback.format_stack(limit=12))
    callers.append(group.__name__ + " read at import: " + stack)
    return real(group)
settings.read = counted
for room in ROOMS:
    package = importlib.import_module(room)
    for info in pkgutil.walk_packages(package.__path__, room + "."):
        importlib.import_module(info.name)
print(json.dumps(callers))
"""


def test_importing_every_product_module_reads_no_setting() -> None:
    code = f"ROOMS = {list(PRODUCT)!r}\n" + _IMPORT_ALL
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    callers = json.loads(done.stdout.strip().splitlines()[-1])
    assert callers == [], callers
