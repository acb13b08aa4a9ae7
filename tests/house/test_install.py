"""The install is locked: `constraints.txt` pins every package the project and its `test` extra take, the README's
first command and CI install through it the same way, and the environment the tests run in is the one it pins."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def _pins_module():
    spec = importlib.util.spec_from_file_location("lock_pins", ROOT / ".ci" / "pins.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["lock_pins"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _constraint_lines() -> list[Requirement]:
    return [
        Requirement(line)
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]


def _constraints() -> dict[str, str]:
    """{name: version} of the pins whose marker holds on this interpreter."""
    pins = {}
    for requirement in _constraint_lines():
        [spec] = requirement.specifier
        assert spec.operator == "==" and requirement.name == canonicalize_name(requirement.name), requirement
        if requirement.marker is None or requirement.marker.evaluate():
            pins[requirement.name] = spec.version
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
    assert lock.constraints_text(lock.needs()) == (ROOT / "constraints.txt").read_text()


def test_every_accepted_python_finds_a_pin_for_every_package_it_takes() -> None:
    """Debian 12's Python 3.11.2 takes async-timeout (through redis) where 3.11.7 does not: a lock made on one Python
    left it unpinned, and the install check failed there every time."""
    lock = _pins_module()
    lines = _constraint_lines()
    for python in lock.PYTHONS:
        holding = {r.name for r in lines if r.marker is None or r.marker.evaluate(lock.environment(python, ""))}
        taken = {name for name, need in lock.needs().items() if python in need.pythons}
        assert taken <= holding, f"Python {python} takes {sorted(taken - holding)} unpinned"
    [timeout] = [r for r in lines if r.name == "async-timeout"]
    assert not timeout.marker.evaluate(lock.environment("3.11.3", "")) and timeout.marker.evaluate(
        lock.environment("3.11.2", "")
    )


def test_the_pythons_the_lock_checks_lie_on_each_side_of_every_marker_s_boundary() -> None:
    """Each release the project accepts decides every Python marker of the closure as the checked one below it."""
    lock = _pins_module()
    checked = sorted(lock.PYTHONS, key=_version)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    accepted = SpecifierSet(project["requires-python"])
    releases = [f"3.{minor}.{patch}" for minor in (11, 12, 13) for patch in range(20)]
    markers = {marker for need in lock.needs().values() for marker in need.markers}
    assert markers, "the closure has Python markers (async-timeout, importlib-metadata): the check must see them"
    for release in (r for r in releases if accepted.contains(r)):
        below = [p for p in checked if _version(p) <= _version(release)][-1]
        for text in markers:
            marker = Marker(text)
            assert marker.evaluate(lock.environment(release, "")) == marker.evaluate(lock.environment(below, "")), (
                f"{text} tells {release} from {below}: add {release} to PYTHONS in .ci/pins.py"
            )


def test_a_package_only_another_python_takes_and_nobody_pinned_stops_the_lock() -> None:
    lock = _pins_module()
    need = lock.Need(pythons={"3.11.0"}, markers=['python_full_version < "3.11.1"'])
    with pytest.raises(SystemExit, match="not-installed-anywhere is taken only on Python 3.11.0.*add"):
        lock.constraint_lines({"not-installed-anywhere": need}, before={})
    assert lock.constraint_lines({"not-installed-anywhere": need}, before={"not-installed-anywhere": "1.0"}) == [
        'not-installed-anywhere==1.0 ; python_full_version < "3.11.1"'
    ]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


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


def test_the_readme_s_cpu_only_install_takes_the_pinned_torch_from_pytorch_s_cpu_index() -> None:
    """The CPU-only line: PyTorch's CPU wheels at constraints.txt's torch, then exactly the GPU line's install."""
    readme = (ROOT / "README.md").read_text()
    [block] = re.findall(
        r"On a machine without a GPU, install PyTorch's CPU-only build.*?```bash\n(.+?)\n```", readme, re.S
    )
    assert (
        "\n" not in block
        and block.startswith("python3.11 -m venv .venv && ")
        and block.endswith(" && .venv/bin/k6vsr demo")
    )
    torch_install, project_install = _pip_installs(block)
    assert torch_install[:2] == ["--index-url", "https://download.pytorch.org/whl/cpu"]
    [pin] = [Requirement(word) for word in torch_install[2:]]
    assert pin.name == "torch" and str(pin.specifier) == f"=={_constraints()['torch']}"
    # The index's build of that version (2.13.0+cpu) still satisfies the constraint the project install applies.
    assert SpecifierSet(f"=={_constraints()['torch']}").contains(f"{_constraints()['torch']}+cpu")
    [ci_install] = _pip_installs((ROOT / ".ci" / "run").read_text())
    assert project_install == ci_install


ROOMS = ("k6vsr_core", "storage", "service", "tasks", "runtime", "flows", "entrypoints")


def test_a_wheel_holds_every_package_and_the_released_configs(tmp_path: Path) -> None:
    """A non-editable install (a wheel, as a deployment's image takes) has every package of the rooms, their
    subpackages too, and the released checkpoint's config files that the model's code reads."""
    import shutil
    import subprocess
    import zipfile

    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copyfile(ROOT / name, source / name)
    for room in ROOMS:
        shutil.copytree(ROOT / room, source / room, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w",
         str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("k6vsr-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(init.relative_to(ROOT)) for room in ROOMS for init in (ROOT / room).rglob("__init__.py")}
    assert {"flows/archive/__init__.py", "entrypoints/server/__init__.py"} <= packages
    assert packages <= names, sorted(packages - names)
    configs = {str(path.relative_to(ROOT)) for path in (ROOT / "k6vsr_core" / "released").rglob("*.json")}
    assert len(configs) == 5 and configs <= names, sorted(configs - names)
