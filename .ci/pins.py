"""The pins of constraints.txt: every distribution the project and its `test` extra need on any Python the project
accepts, at the version installed in the running interpreter's environment.

Run by `.ci/lock` inside a freshly resolved virtualenv; `tests/house/test_install.py` runs it in the test environment
(installed from constraints.txt) and compares, so a dependency added without its pin fails there.

A dependency that only some of the accepted Pythons take (redis takes async-timeout below 3.11.3; dask takes
importlib-metadata below 3.12) is written with its requirement's marker, so a lock made on one Python holds on the
others: pip skips a constraint whose marker is false, and a missing pin would let pip take a package's newest release.
Where the running interpreter does not take such a package, its version is the one constraints.txt already pins;
a package new to the lock and absent here gets an error that says what to add.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROJECT = "k6vsr"
EXTRAS = ("test",)
# One interpreter on each side of every Python boundary the dependency closure's markers draw, within
# requires-python (>=3.11,<3.13); tests/house/test_install.py checks that no marker tells two of the same minor apart
# in a way these miss.
PYTHONS = ("3.11.0", "3.11.2", "3.11.3", "3.11.9", "3.12.0", "3.12.9")
CONSTRAINTS = Path(__file__).resolve().parents[1] / "constraints.txt"
HEADER = """\
# Every package the project and its `test` extra install, at one version each: `pip install -c constraints.txt`
# resolves without backtracking and gives every machine the same environment. Written by `.ci/lock` (do not edit);
# torch's local label (+cpu) is dropped, so a CPU machine keeps its CPU wheel and a GPU machine takes PyPI's.
# A package only some Pythons take carries its requirement's marker (`.ci/pins.py`).
"""


@dataclass
class Need:
    """Which accepted Pythons take a package, and the markers of the requirements that bring it where not all do."""

    pythons: set[str] = field(default_factory=set)
    markers: list[str] = field(default_factory=list)


def environment(python: str, extra: str) -> dict[str, str]:
    return {"python_full_version": python, "python_version": ".".join(python.split(".")[:2]), "extra": extra}


def _installed(name: str) -> metadata.Distribution | None:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None


def needs(project: str = PROJECT, extras: tuple[str, ...] = EXTRAS) -> dict[str, Need]:
    """{canonical name: Need} of the project's dependency closure with `extras` over `PYTHONS`, the project left out.

    A package not installed here is taken as a leaf: its own requirements cannot be read here (async-timeout, the
    one such package today, has none)."""
    found: dict[str, Need] = {}
    for python in PYTHONS:
        seen: set[tuple[str, str]] = set()
        todo: list[tuple[str, frozenset[str]]] = [(project, frozenset(extras))]
        while todo:
            name, wanted = todo.pop()
            dist = _installed(name)
            if dist is None:
                continue
            for extra in wanted | {""}:
                if (name, extra) in seen:
                    continue
                seen.add((name, extra))
                for line in dist.requires or []:
                    requirement = Requirement(line)
                    marker = requirement.marker
                    if marker is None and extra:
                        continue  # an unconditional requirement, taken with extra ""
                    if marker is not None and not marker.evaluate(environment(python, extra)):
                        continue
                    child = canonicalize_name(requirement.name)
                    if child != canonicalize_name(project):
                        need = found.setdefault(child, Need())
                        need.pythons.add(python)
                        if marker is not None and _python_only(marker) and str(marker) not in need.markers:
                            need.markers.append(str(marker))
                    todo.append((child, frozenset(requirement.extras)))
    return found


def _python_only(marker: Marker) -> bool:
    """Whether the marker speaks of the Python version alone: the line written with it must hold on any machine."""
    return "extra" not in str(marker) and all(
        marker.evaluate({**environment(python, ""), "sys_platform": platform, "platform_system": system})
        == marker.evaluate(environment(python, ""))
        for python in PYTHONS
        for platform, system in (("linux", "Linux"), ("win32", "Windows"), ("darwin", "Darwin"))
    )


def pinned_before(path: Path = CONSTRAINTS) -> dict[str, str]:
    """{name: version} of the constraints file as it is now."""
    pins = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line and not line.startswith("#"):
                name, _, rest = line.partition("==")
                pins[name.strip()] = rest.split(";", 1)[0].strip()
    return pins


def _local_free(version: str) -> str:
    return version.split("+", 1)[0]


def constraint_lines(found: dict[str, Need], before: dict[str, str]) -> list[str]:
    lines = []
    for name, need in sorted(found.items()):
        dist = _installed(name)
        version = _local_free(dist.version) if dist is not None else before.get(name)
        if version is None:
            raise SystemExit(
                f"{name} is taken only on Python {', '.join(sorted(need.pythons))}, not by this interpreter, and "
                f"constraints.txt has no pin for it: add `{name}==VERSION` there, or lock on one of those Pythons"
            )
        if need.pythons == set(PYTHONS):
            lines.append(f"{name}=={version}")
        else:
            if not need.markers:
                raise SystemExit(
                    f"{name} is taken only on Python {sorted(need.pythons)} through a marker not of Python"
                )
            marker = " or ".join(f"({m})" if len(need.markers) > 1 else m for m in need.markers)
            lines.append(f"{name}=={version} ; {marker}")
    return lines


def constraints_text(found: dict[str, Need], before: dict[str, str] | None = None) -> str:
    return HEADER + "".join(
        f"{line}\n" for line in constraint_lines(found, pinned_before() if before is None else before)
    )


if __name__ == "__main__":
    sys.stdout.write(constraints_text(needs()))
