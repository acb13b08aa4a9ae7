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


def test_the_demo_s_tiny_model_is_named_where_a_newcomer_without_a_gpu_looks(capsys: pytest.CaptureFixture) -> None:
    """The default model is the released checkpoint, fetched from the hub: on a CPU machine every command needs the
    demo's tiny bundle instead, and the demo's help, every `--model` help and the demo's last line say so."""
    from pathlib import Path

    from entrypoints.demo import next_step

    assert "k6vsr-demo/tiny-bundle" in cli.COMMANDS["demo"].help
    for name in ("upscale", "plan", "preview", "archive", "serve"):
        [model] = [a for a in _subcommand_parsers()[name]._actions if "--model" in a.option_strings]
        assert "k6vsr-demo/tiny-bundle" in model.help, name
    summary = {
        "size": [256, 192],
        "frames": 9,
        "fps": 24,
        "timings": {"decode": 1.0},
        "output": "out.mp4",
        "run_key": "key",
        "tiles_computed": 6,
        "tiles_total": 6,
        "tiles_reused": 0,
        "dit_calls": 12,
        "reused_output": False,
        "store": "store",
        "log": "run.log",
    }
    cli.COMMANDS["demo"].show({**summary, "next": next_step(Path("k6vsr-demo") / "tiny-bundle")})
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("next: ") and "--model k6vsr-demo/tiny-bundle --device cpu`" in last, last
