"""The click options made from the config fields: each field that declares a ``flag`` (``dflash_pipe.fields``)
becomes one option of ``launch`` (and of ``regenerate`` where it shares one), typed from the field's type,
so an option is declared once, next to its field."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from dflash_pipe.fields import Flag, flag_of
from dflash_pipe.run.config import RunConfig


class FieldOption(click.Option):
    """A ``launch`` option made from a config field's ``flag`` metadata; ``field_path`` is the field it sets
    ("data.token_budget")."""

    def __init__(self, *args: Any, field_path: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.field_path = field_path


def config_flags(kind: type = RunConfig, prefix: str = "") -> list[tuple[str, dataclasses.Field, Any]]:
    """(dotted path, field, type) of every field with a flag, in field order, the sections' fields in
    their section's place."""
    hints = typing.get_type_hints(kind)
    out: list[tuple[str, dataclasses.Field, Any]] = []
    for f in dataclasses.fields(kind):
        if dataclasses.is_dataclass(hints[f.name]):
            out += config_flags(hints[f.name], f"{prefix}{f.name}.")
        elif flag_of(f) is not None:
            out.append((prefix + f.name, f, hints[f.name]))
    return out


def _click_type(hint: Any, spec: Flag) -> dict[str, Any]:
    """click's type for a field's type: Literal -> Choice, bool -> a flag, Path, int, float; str, tuple
    (comma-separated, parsed by ``_flag_value``) and dict (repeatable KEY=VALUE) are text."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (types.UnionType, typing.Union) and len(args) == 1:
        hint = args[0]
    if spec.choices is not None:
        return {"type": click.Choice(list(spec.choices))}
    if typing.get_origin(hint) is typing.Literal:
        return {"type": click.Choice([str(a) for a in typing.get_args(hint)])}
    if hint is bool:
        return {"is_flag": True}
    if hint in (int, float):
        return {"type": hint}
    if hint is Path:
        return {"type": click.Path(path_type=Path)}
    if hint is str or typing.get_origin(hint) in (tuple, dict):
        return {}
    raise TypeError(f"no command-line type for a field of type {hint!r}; give its flag choices or change it")


def _chosen(paths: tuple[str, ...]) -> list[tuple[str, dataclasses.Field, Any]]:
    every = config_flags()
    by_path = {path: (f, hint) for path, f, hint in every}
    unknown = sorted(set(paths) - set(by_path))
    if unknown:
        raise KeyError(f"no config field with a flag at {unknown}")
    return [(p, *by_path[p]) for p in paths] if paths else every


def field_options(
    *paths: str, overrides: dict[str, dict[str, Any]] | None = None
) -> Callable[[Callable], Callable]:
    """The click options of the config fields ``paths`` (none given: every field with a flag, in field
    order), each declared by its field's ``flag``: name, help and whether it shows a default.
    ``overrides``: per path, click settings a command that is not ``launch`` changes (a bench's own
    default and why), the name and type staying the field's."""
    overrides = overrides or {}
    unused = sorted(set(overrides) - set(paths))
    if unused:
        raise KeyError(f"overrides for fields not among the options: {unused}")
    options = []
    for path, f, hint in _chosen(paths):
        spec = flag_of(f)
        assert spec is not None
        kwargs: dict[str, Any] = {"help": spec.help, **_click_type(hint, spec)}
        if spec.multiple:
            kwargs["multiple"] = True
        if spec.metavar:
            kwargs["metavar"] = spec.metavar
        if spec.default is not None:
            kwargs.update(default=spec.default, show_default=True)
        kwargs.update(overrides.get(path, {}))
        options.append(click.option(spec.name, spec.param_name, cls=FieldOption, field_path=path, **kwargs))

    def apply(fn: Callable) -> Callable:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return apply


def add_field_arguments(
    parser: argparse.ArgumentParser, *paths: str, unset: bool = False, **defaults: Any
) -> None:
    """The same fields' flags on a bench script's argparse parser: name, help, type and default from the
    field; ``defaults`` by click parameter name (``token_budget=8192``) where the script's differ.
    ``unset``: a flag not typed stays None (a script that passes only what was typed on to ``launch``)."""
    for _, f, hint in _chosen(paths):
        spec = flag_of(f)
        assert spec is not None
        click_kwargs = _click_type(hint, spec)
        field_default = None if unset or f.default is dataclasses.MISSING else f.default
        kwargs: dict[str, Any] = {"dest": spec.param_name, "help": spec.help}
        kwargs["default"] = defaults.get(spec.param_name, field_default)
        kind = click_kwargs.get("type", str)
        if click_kwargs.get("is_flag"):
            kwargs["action"] = "store_true"
        elif isinstance(kind, click.Choice):
            kwargs["choices"] = list(kind.choices)
        else:
            kwargs["type"] = Path if isinstance(kind, click.Path) else kind
        parser.add_argument(spec.name, **kwargs)


def field_params(*paths: str) -> tuple[str, ...]:
    """The click parameter names of these fields' flags (``data.path`` -> ``data_path``)."""
    return tuple(flag_of(f).param_name for _, f, _ in _chosen(paths))  # type: ignore[union-attr]


def field_argv(values: dict[str, Any], *paths: str) -> list[str]:
    """The ``launch`` flags that set these fields to ``values`` (by parameter name; None: left out), for a
    script that starts ``launch`` itself."""
    argv: list[str] = []
    for _, f, _ in _chosen(paths):
        spec = flag_of(f)
        assert spec is not None
        if values.get(spec.param_name) is not None:
            argv += [spec.name, str(values[spec.param_name])]
    return argv


def section_values(opts: dict[str, Any], section: str) -> dict[str, Any]:
    """The given (not None) flags of one config section as its field names, e.g. ``regen``'s
    ``{"seed": 3}`` for ``--regen-seed 3``."""
    out = {}
    for path, f, _ in config_flags():
        spec = flag_of(f)
        if path.startswith(section + ".") and spec and opts.get(spec.param_name) is not None:
            out[f.name] = opts[spec.param_name]
    return out
