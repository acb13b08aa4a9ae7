"""The rooms and their one-way imports, read from the source with `ast` (nothing is imported, so nothing is hidden).

    entrypoints -> flows -> runtime -> tasks -> service -> {k6vsr_core, storage};  storage -> k6vsr_core

Each room imports only from the rooms below it. k6vsr_core is the model contract (no Prefect, Zarr or Dask); storage
knows where bytes live (no Prefect, diffusers or Dask); service is what the entry points share (no Prefect);
runtime runs no flow: it is what flows run on and what outlives them (the local Prefect server and flow-run leases,
the warm workers, task runners, lanes and the scheduler); only the entry points see argparse. `bench/` stands above
them all and no room imports it. No module, the benchmarks' included, imports itself back through others, whether
the import is at the top or inside a function.

Inside k6vsr_core, rooms by job, each importing only the ones it stands on (and the core's own errors, settings and
status, and its lazy exports, at its top):

    model -> {contract, device};  contract -> media;  device, media -> nothing of the others
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("entrypoints", "flows", "runtime", "tasks", "service", "storage", "k6vsr_core")  # top to bottom
SCANNED = (*ROOMS, "bench")  # the benchmarks may import any room; the cycle rule covers them too
ORCHESTRATION = {"prefect", "prefect_dask", "dask", "distributed", "dask_cuda"}
# Besides every room above it (and bench), what each room may not import.
LIBRARIES = {
    "entrypoints": set(),
    "flows": {"argparse"},
    "runtime": {"argparse"},
    "tasks": {"argparse"},
    "service": ORCHESTRATION | {"argparse"},
    "storage": ORCHESTRATION | {"diffusers", "argparse"},
    "k6vsr_core": ORCHESTRATION | {"zarr", "argparse"},
}
FORBIDDEN = {room: {*ROOMS[:above], "bench"} | LIBRARIES[room] for above, room in enumerate(ROOMS)}


def _modules() -> dict[str, Path]:
    found = {}
    for room in SCANNED:
        for path in sorted((ROOT / room).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in it; `from package import module` names the module."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                names.add(submodule if submodule in MODULES else node.module)
    return names


IMPORTS = {module: _imports(path) for module, path in MODULES.items()}


@pytest.mark.parametrize("room", ROOMS)
def test_room_imports_only_what_it_may(room: str) -> None:
    bad = sorted(
        f"{module} imports {name}"
        for module, names in IMPORTS.items()
        if module.split(".")[0] == room
        for name in names
        if name.split(".")[0] in FORBIDDEN[room]
    )
    assert bad == []


# The rooms inside k6vsr_core and what each may import of the others.
CORE_ROOMS = {
    "model": {"contract", "device", "media"},
    "contract": {"media"},
    "device": set(),
    "media": set(),
}


def test_the_core_s_rooms_import_only_what_they_stand_on() -> None:
    def room_of(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 2 and parts[0] == "k6vsr_core" and parts[1] in CORE_ROOMS else None

    core = [m for m, path in MODULES.items() if m.startswith("k6vsr_core.") and path.stem != "__init__"]
    flat = sorted(m for m in core if m.count(".") == 1)
    assert flat == [
        "k6vsr_core.errors",
        "k6vsr_core.lazy",
        "k6vsr_core.settings",
        "k6vsr_core.status",
    ]  # the rest: rooms
    bad = sorted(
        f"{module} imports {name}"
        for module, names in IMPORTS.items()
        if (room := room_of(module)) is not None
        for name in names
        if (other := room_of(name)) is not None and other != room and other not in CORE_ROOMS[room]
    )
    assert bad == []


def test_no_import_cycles() -> None:
    graph = {
        module: {name for name in names if name in MODULES and name != module} for module, names in IMPORTS.items()
    }
    state: dict[str, str] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for name in sorted(graph[module]):
            if state.get(name) == "open":
                cycles.append(" -> ".join([*path[path.index(name) :], name]))
            elif name not in state:
                visit(name, [*path, name])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_rule_sees_imports_inside_functions(tmp_path: Path) -> None:
    source = tmp_path / "sample.py"
    source.write_text(
        "def f():\n    from flows.orchestrate import run_clip\n    import prefect.settings\n"
        "    from k6vsr_core import media\n"
    )
    assert _imports(source) == {"flows.orchestrate", "prefect.settings", "k6vsr_core.media"}


def test_the_benchmarks_are_read_too() -> None:
    assert {"bench.device_check", "bench.same_bytes", "bench.streaming", "bench.two_gpus"} <= set(MODULES)
