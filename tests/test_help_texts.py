"""Every option of every command says what it is for in `--help` (`serve --help` listed --host and --port bare)."""

from __future__ import annotations

import argparse

import pytest

from entrypoints import cli


def _subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = {}
    for name, command in cli.COMMANDS.items():
        parser = argparse.ArgumentParser(prog=f"k6vsr {name}", **command.parser_options)
        command.flags(parser)
        found[name] = parser
    return found


def _bare_options(parser: argparse.ArgumentParser, path: str) -> list[str]:
    bare = []
    for action in parser._actions:  # argparse keeps no public list of its actions
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                bare += _bare_options(sub, f"{path} {name}")
        elif action.option_strings and action.help not in (argparse.SUPPRESS,) and not (action.help or "").strip():
            bare.append(f"{path} {'/'.join(action.option_strings)}")
    return bare


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_option_has_a_help_text(name: str) -> None:
    assert _bare_options(_subcommand_parsers()[name], f"k6vsr {name}") == []
