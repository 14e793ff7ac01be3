"""``--config FILE`` on every command besides ``launch`` (which reads a run config): the file's keys are
option names, its values become the command's defaults, so typed flags still win."""

from __future__ import annotations

from pathlib import Path

import click


def _load_option_file(ctx: click.Context, param: click.Parameter, value: Path | None) -> None:
    """Eager: the file's values become this command's defaults, so typed flags still win."""
    from dflash_pipe.run.config_file import ConfigFileError, load_file, option_defaults

    if value is None:
        return
    try:
        defaults = option_defaults(load_file(value), ctx.command.params, source=str(value))
    except ConfigFileError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
    ctx.default_map = {**(ctx.default_map or {}), **defaults}


def add_config_options(group: click.Group) -> None:
    """Every command takes --config; `launch` has its own (a run config), the others a flat option file."""
    for command in group.commands.values():
        if isinstance(command, click.Group):
            add_config_options(command)
        elif not any(p.name == "config_file" for p in command.params):
            command.params.append(
                click.Option(
                    ["--config", "config_file"],
                    type=click.Path(exists=True, dir_okay=False, path_type=Path),
                    is_eager=True,
                    expose_value=False,
                    callback=_load_option_file,
                    help="YAML, TOML or JSON file of this command's options (keys: option names); "
                    "flags override it.",
                )
            )
