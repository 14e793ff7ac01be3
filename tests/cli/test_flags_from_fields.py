"""`launch`'s options are made from the config fields: each field reachable from the command line declares
its flag once (name, help, resume) in its metadata, and the option's type comes from the field's type."""

from __future__ import annotations

import typing

import click
import pytest
from click.testing import CliRunner

from dflash_pipe.cli import main
from dflash_pipe.commands.launch_config import FLAG_FIELDS, RESUME_OVERRIDES
from dflash_pipe.commands.options import FieldOption, config_flags
from dflash_pipe.fields import flag_of

NOT_FIELDS = {"resume_dir", "live", "config_file", "print_config", "dry_run", "gpus"}
"""launch options that set no config field: what to do with the config (``gpus``: a probe then sets
``layout.target_gpus`` and ``layout.drafter_gpus``)."""


def test_every_launch_option_is_a_field_or_says_what_to_do_with_the_config() -> None:
    launch = main.commands["launch"]
    options = [p for p in launch.params if isinstance(p, click.Option)]
    hand_written = {p.name for p in options if not isinstance(p, FieldOption)}
    assert hand_written == NOT_FIELDS
    made = [p for p in options if isinstance(p, FieldOption)]
    paths = [p.field_path for p in made]
    assert len(paths) == len(set(paths)), "a field with two options"
    assert {p.name: p.field_path for p in made} == FLAG_FIELDS
    fields = {path: f for path, f, _ in config_flags()}
    assert set(paths) == set(fields)  # every field with a flag is an option of launch, once
    for p in made:
        spec = flag_of(fields[p.field_path])
        assert spec is not None and p.opts == [spec.name] and p.help == spec.help, p.field_path
    names = [o for p in options for o in p.opts]
    assert len(names) == len(set(names)), "a flag name used twice"


def test_a_literal_field_is_a_choice_of_its_values() -> None:
    launch = {p.name: p for p in main.commands["launch"].params}
    for path, f, hint in config_flags():
        spec = flag_of(f)
        assert spec is not None
        if typing.get_origin(hint) is typing.Literal and spec.choices is None:
            option = launch[spec.param_name]
            assert isinstance(option.type, click.Choice), path
            assert list(option.type.choices) == [str(v) for v in typing.get_args(hint)], path


def test_resume_overrides_come_from_the_fields() -> None:
    assert {"max_steps", "epochs", "peer_timeout", "log", "device"} <= RESUME_OVERRIDES
    assert "lr" not in RESUME_OVERRIDES and "token_budget" not in RESUME_OVERRIDES


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--wire-dtype", "fp16"], "'fp16' is not one of 'bf16', 'fp8'"),
        (["--compile", "maybe"], "'maybe' is not one of 'auto', 'full', 'attention', 'off', 'on'"),
        (["--drafter-mode", "fibers"], "'fibers' is not one of 'processes', 'threads'"),
    ],
)
def test_a_bad_choice_is_refused_by_the_command_line(tmp_path, flags: list[str], needle: str) -> None:
    result = CliRunner().invoke(main, ["launch", "--dry-run", "--run-dir", str(tmp_path), *flags])
    assert result.exit_code == 2 and needle in result.output, result.output


def test_the_command_line_imports_neither_torch_nor_zmq() -> None:
    """Its options come from the config modules now: they must stay light, since `worker` points the
    compile cache's environment at the run before torch (and Inductor) read it."""
    import subprocess
    import sys

    code = "import sys, dflash_pipe.cli; print(sorted({'torch', 'zmq', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
