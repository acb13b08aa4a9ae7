"""The install is locked: `constraints.txt` pins every package the project and its `test` extra take, the README's
first command and CI install through it the same way, and the environment the tests run in is the one it pins."""

from __future__ import annotations

import importlib.util
import re
import shlex
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def _pins_module():
    spec = importlib.util.spec_from_file_location("lock_pins", ROOT / ".ci" / "pins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and name == canonicalize_name(name), f"not a canonical name==version pin: {line!r}"
            pins[name] = version
    return pins


def _pip_installs(text: str) -> list[list[str]]:
    """The arguments of every `pip install` of a shell text, without `-q`."""
    found = []
    for line in text.splitlines():
        for command in re.split(r"&&|;", line):
            words = shlex.split(command, comments=True)
            if len(words) > 2 and words[0].endswith("bin/pip") and words[1] == "install":
                found.append([word for word in words[2:] if word != "-q"])
    return found


def test_every_requirement_has_a_pin_that_satisfies_it() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    requirements = [Requirement(line) for line in project["dependencies"] + extras["test"] + extras["s3"]]
    pins = _constraints()
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        if name == "k6vsr":
            continue
        assert name in pins, f"{requirement} has no pin in constraints.txt: run .ci/lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} breaks {requirement}"
        )
    assert pins["torch"] == "2.13.0"  # a CPU machine keeps its CPU wheel; no local label (+cpu) in the pin


def test_the_test_environment_is_the_one_the_constraints_pin() -> None:
    """What `.ci/lock` would write from this environment is constraints.txt: no requirement is left unpinned (pip
    would take its newest release) and no installed version differs from its pin."""
    lock = _pins_module()
    assert lock.constraints_text(lock.pins()) == (ROOT / "constraints.txt").read_text()


def test_the_readme_and_ci_install_the_same_way() -> None:
    readme = (ROOT / "README.md").read_text()
    first = readme.split("```bash\n", 1)[1].split("\n```", 1)[0]
    assert "\n" not in first and first.startswith("python3.11 -m venv .venv && ")
    [readme_install] = _pip_installs(first)
    [ci_install] = _pip_installs((ROOT / ".ci" / "run").read_text())
    assert readme_install == ci_install
    assert readme_install[:2] == ["-c", "constraints.txt"]


def test_the_demos_folder_is_not_committed_by_accident() -> None:
    """`k6vsr demo` writes `k6vsr-demo/` (a model, a clip, a store) in the folder it runs in: the checkout's root."""
    assert "/k6vsr-demo/" in (ROOT / ".gitignore").read_text().splitlines()
