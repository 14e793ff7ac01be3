"""docs/cli.md and docs/configuration.md are generated; they must match the code."""

from __future__ import annotations

from pathlib import Path

from dflash_pipe.reference import cli_reference, config_reference

DOCS = Path(__file__).resolve().parents[2] / "docs"
FIX = "out of date: run `python scripts/gen_cli_docs.py` and commit the result"


def test_cli_reference_is_current():
    assert (DOCS / "cli.md").read_text() == cli_reference(), f"docs/cli.md is {FIX}"


def test_configuration_reference_is_current():
    assert (DOCS / "configuration.md").read_text() == config_reference(), f"docs/configuration.md is {FIX}"


def test_references_cover_every_command_and_field():
    cli = cli_reference()
    for command in ("launch", "worker", "export", "eval", "report"):
        assert f"### `dflash-pipe {command}`" in cli
    assert "_DFLASH_PIPE_COMPLETE=bash_source dflash-pipe" in cli
    conf = config_reference()
    for key in (
        "`run_dir`",
        "`data.token_budget`",
        "`drafter.max_anchors`",
        "`train.lr`",
        "`wire.bind`",
        "`layout.target_gpus`",
        "`log`",
    ):
        assert key in conf, key


def test_every_command_has_help_with_an_example():
    from dflash_pipe.cli import main

    def walk(group, path):
        for name, command in group.commands.items():
            if hasattr(command, "commands"):
                yield from walk(command, f"{path} {name}")
            else:
                yield f"{path} {name}", command

    for path, command in walk(main, "dflash-pipe"):
        assert command.help and "dflash-pipe" in command.help, f"{path}: --help has no example"
