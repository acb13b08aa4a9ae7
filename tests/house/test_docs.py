"""The README is a map and the docs are the territory: the README stays short, every link between them leads to a
file and a heading that exist, and every `k6vsr` command line they show names a command and flags that exist."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from entrypoints.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LINES = 300
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A command line in a code span or a fenced block: the program (a path ending in k6vsr) and its arguments.
COMMAND = re.compile(r"(?:^|[\s`(/])k6vsr((?: +[^`|\n#;&]+)?)")


def headings(page: Path) -> set[str]:
    """GitHub's anchors of `page`'s headings (outside fenced blocks)."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            title = line.split(" ", 1)[1].strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def code(page: Path) -> list[str]:
    """The text of `page`'s code spans and fenced blocks, a line each."""
    found, fenced = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            found.append(line.split(" #", 1)[0])
        else:
            found += re.findall(r"`([^`]+)`", line)
    return found


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_the_readme_is_a_map() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines: move a section into docs/"
    assert any(line.startswith("## Where to read on") for line in lines)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_leads_to_a_file_and_heading_that_exist(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in headings(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_command_line_shown_names_a_command_and_flags_that_exist(page: Path) -> None:
    commands = subparsers(build_parser())
    wrong = []
    for snippet in code(page):
        for match in COMMAND.finditer(snippet):
            words = match.group(1).split()
            if not words or words[0].startswith("-") and words[0] not in ("--help", "-h"):
                continue
            name = words[0]
            if name in ("--help", "-h"):
                continue
            if not re.fullmatch(r"[a-z]+", name):  # a path or a placeholder after the program: no command named
                continue
            if name not in commands:
                wrong.append(f"`k6vsr {name}`: no such command")
                continue
            known = set(commands[name]._option_string_actions)
            for word in words[1:]:
                flag = re.match(r"\[?(--?[a-z][a-z0-9-]*)", word)
                if flag and flag.group(1) not in known:
                    wrong.append(f"`k6vsr {name} ... {flag.group(1)}`: no such flag")
    assert not wrong, f"{page.name}: " + "; ".join(sorted(set(wrong)))
