"""What a config field declares besides its type, default and docstring: the ``launch`` flag that sets it.

``flag("--token-budget", "Max tokens per batch ...")`` goes into the field's metadata; the command line
is made from these (``commands.options.field_options``: the click type from the field's type, a ``Literal``
becoming a ``click.Choice``), so an option is declared once, next to its field. ``choices`` reads a
``Literal`` field's values for the field's own validation, so an enum is listed once too; ``build``
makes a config from a mapping, naming unknown keys.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any

CLI = "cli"
"""The metadata key of a field's ``Flag``."""


@dataclass(frozen=True, slots=True)
class Flag:
    """How ``dflash-pipe launch`` sets a field."""

    name: str
    """The option, e.g. "--token-budget"."""
    help: str
    param: str | None = None
    """The click parameter name when it is not the flag's (``--data`` -> data_path)."""
    resume: bool = False
    """May change on ``--resume`` (the rest comes from the run's saved config)."""
    multiple: bool = False
    """Repeatable (``--log tensorboard --log wandb``)."""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    """The values the flag takes when they are not the field's ``Literal`` (``--device auto``)."""
    default: Any = None
    """A default the option shows in --help; None: the config's (unset flags leave the config's value)."""

    @property
    def param_name(self) -> str:
        return self.param or self.name.removeprefix("--").replace("-", "_")


def flag(name: str, help: str, **options: Any) -> dict[str, Flag]:
    """Field metadata for ``dataclasses.field(metadata=...)``."""
    return {CLI: Flag(name, " ".join(help.split()), **options)}


def flag_of(f: dataclasses.Field) -> Flag | None:
    return f.metadata.get(CLI)


@functools.cache
def choices(kind: type, name: str) -> tuple[Any, ...]:
    """The values of the ``Literal`` field ``name`` of the dataclass ``kind``."""
    hint = typing.get_type_hints(kind)[name]
    if typing.get_origin(hint) is not typing.Literal:
        raise TypeError(f"{kind.__name__}.{name} is not a Literal field")
    return typing.get_args(hint)


def check_choice(obj: Any, name: str, label: str, hint: str = "") -> None:
    """ValueError "LABEL must be a, b or c, got 'x'." when ``obj.name`` is not one of its Literal's values."""
    allowed = choices(type(obj), name)
    value = getattr(obj, name)
    if value not in allowed:
        words = [str(a) for a in allowed]
        listed = ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else words[0]
        raise ValueError(f"{label} must be {listed}, got {value!r}{hint}.")


def build(kind: type, values: dict[str, Any], where: str, hint: str = "") -> Any:
    """``kind(**values)``, naming unknown keys and the valid ones (not a TypeError) when there are any."""
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"Unknown {where} config key(s) {unknown}; valid keys are {sorted(names)}{hint}.")
    return kind(**values)
