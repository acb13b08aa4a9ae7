"""The pins of constraints.txt: every distribution the project and its `test` extra need, as installed in the
running interpreter's environment, at the version installed there.

Run by `.ci/lock` inside a freshly resolved virtualenv; `tests/test_install.py` runs it in the test environment
(installed from constraints.txt) and compares, so a dependency added without its pin fails there.
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROJECT = "k6vsr"
EXTRAS = ("test",)
HEADER = """\
# Every package the project and its `test` extra install, at one version each: `pip install -c constraints.txt`
# resolves without backtracking and gives every machine the same environment. Written by `.ci/lock` (do not edit);
# torch's local label (+cpu) is dropped, so a CPU machine keeps its CPU wheel and a GPU machine takes PyPI's.
"""


def _local_free(version: str) -> str:
    return version.split("+", 1)[0]


def pins(project: str = PROJECT, extras: tuple[str, ...] = EXTRAS) -> dict[str, str]:
    """{canonical name: version} of the project's dependency closure with `extras`, the project itself left out."""
    found: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    todo: list[tuple[str, frozenset[str]]] = [(project, frozenset(extras))]
    while todo:
        name, wanted = todo.pop()
        for extra in wanted | {""}:
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            dist = metadata.distribution(name)
            for line in dist.requires or []:
                requirement = Requirement(line)
                if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
                    continue
                if requirement.marker is None and extra:
                    continue  # an unconditional requirement, taken with extra ""
                child = canonicalize_name(requirement.name)
                if child != canonicalize_name(project):
                    found[child] = _local_free(metadata.version(child))
                todo.append((child, frozenset(requirement.extras)))
    return found


def constraints_text(found: dict[str, str]) -> str:
    return HEADER + "".join(f"{name}=={version}\n" for name, version in sorted(found.items()))


if __name__ == "__main__":
    sys.stdout.write(constraints_text(pins()))
