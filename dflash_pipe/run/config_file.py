"""Config files (YAML, TOML or JSON) for every command: loaded, key-checked and typed before click sees them.

Two shapes, one per kind of command:

- ``launch`` reads a *run config*: the sections of `RunConfig` (``data``, ``drafter``, ``train``, ``wire``,
  ``layout``) and its top-level fields, exactly the shape of the ``config.json`` a run dir keeps (so a
  run's ``config.json`` or ``launch --print-config`` output is a valid ``--config``).
- every other command reads a flat mapping of its own option names (``connect: tcp://...``, ``gpus: 6,7``),
  which becomes click's ``default_map``: whatever the user types on the command line wins.

Unknown keys are errors that name the key, the file and the valid keys. Values are converted to the
field's type here (YAML reads ``6e-4`` as a string, for one), so a typo is a message, not a traceback.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import textwrap
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SUFFIXES = (".yaml", ".yml", ".toml", ".json")


class ConfigFileError(ValueError):
    """A config file that cannot be read or does not fit the command; the message names the file and key."""


def load_file(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML / TOML / JSON file (by suffix)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigFileError(
            f"{path}: unknown config file type {suffix!r}; use one of {', '.join(SUFFIXES)}."
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigFileError(f"{path}: cannot read the config file ({exc.strerror or exc}).") from None
    try:
        if suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        elif suffix == ".toml":
            data = _toml().loads(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # each parser has its own error type; all name the line
        raise ConfigFileError(f"{path}: not valid {suffix[1:].upper()}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}.")
    return data


def _toml():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigFileError(
                "TOML config files need Python >= 3.11 or `pip install tomli`; or use YAML."
            ) from None
    return tomllib


def dump(data: Mapping[str, Any]) -> str:
    """YAML text of a config mapping (block style, keys in the dataclasses' order)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def flow_list(dumper, value):  # lists inline ([0.9, 0.95]), mappings as blocks
        return dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=True)

    Dumper.add_representer(list, flow_list)
    return yaml.dump(dict(data), Dumper=Dumper, sort_keys=False, default_flow_style=False, width=100)


# --- run configs (launch) --------------------------------------------------------------------------------


def run_sections() -> dict[str, type]:
    """RunConfig's nested sections: key -> dataclass."""
    from dflash_pipe.run.config import RunConfig

    hints = typing.get_type_hints(RunConfig)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(RunConfig)
        if dataclasses.is_dataclass(hints[f.name])
    }


def check_run_file(
    data: Mapping[str, Any], *, source: str, hints: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Check a run-config mapping against RunConfig and convert its values; returns a nested dict.

    ``hints`` maps launch flag names (``target_gpus``) to their field path (``layout.target_gpus``), so a
    flag name used as a key gets a "did you mean" in the error.
    """
    from dflash_pipe.run.config import RunConfig

    sections = run_sections()
    out: dict[str, Any] = {}
    top = {f.name for f in dataclasses.fields(RunConfig)}
    for key, value in data.items():
        if key not in top:
            raise ConfigFileError(_unknown(source, str(key), top, hints))
        if key in sections:
            if not isinstance(value, Mapping):
                raise ConfigFileError(
                    f"{source}: `{key}` must be a mapping of {sections[key].__name__} fields, "
                    f"got {type(value).__name__}."
                )
            out[key] = _check_fields(sections[key], value, source=source, prefix=f"{key}.")
        else:
            out[key] = _check_fields(RunConfig, {key: value}, source=source, prefix="")[key]
    return out


def _check_fields(kind: type, values: Mapping[str, Any], *, source: str, prefix: str) -> dict[str, Any]:
    hints = typing.get_type_hints(kind)
    names = [f.name for f in dataclasses.fields(kind)]
    out = {}
    for key, value in values.items():
        if key not in names:
            raise ConfigFileError(_unknown(source, prefix + str(key), names, None, prefix=prefix))
        try:
            out[key] = convert(value, hints[key], key=prefix + key)
        except ValueError as exc:
            raise ConfigFileError(f"{source}: {exc}") from None
    return out


def _unknown(source: str, key: str, valid, hints: Mapping[str, str] | None, *, prefix: str = "") -> str:
    valid = sorted(valid)
    msg = f"{source}: unknown key `{key}`"
    if prefix:
        msg += f" in section `{prefix[:-1]}`"
    msg += f". Valid keys{' there' if prefix else ''}: {', '.join(valid)}."
    bare = key.removeprefix(prefix).replace("-", "_")
    if hints and bare in hints:
        msg += f" (`{bare}` is a flag; in a config file it is `{hints[bare]}`.)"
    else:
        close = difflib.get_close_matches(bare, valid, n=1, cutoff=0.5)
        if close:
            msg += f" Did you mean `{prefix}{close[0]}`?"
    return msg


def convert(value: Any, hint: Any, *, key: str) -> Any:
    """``value`` (as read from a file) converted to the type ``hint`` of a config field, or ValueError."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return convert(value, arg, key=key)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0])
    if origin is typing.Literal:
        if value not in args:
            raise ValueError(f"`{key}` must be one of {', '.join(map(str, args))}; got {value!r}.")
        return value
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ValueError(f"`{key}` must be a list, got {value!r}.")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(convert(v, args[0], key=key) for v in value)
        if len(value) != len(args):
            raise ValueError(f"`{key}` must be a list of {len(args)} values, got {value!r}.")
        return tuple(convert(v, a, key=key) for v, a in zip(value, args, strict=True))
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"`{key}` must be true or false, got {value!r}.")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"`{key}` must be an integer, got {value!r}.")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads 6e-4 (no dot) as a string
            except ValueError:
                pass
        raise ValueError(f"`{key}` must be a number, got {value!r}.")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"`{key}` must be a string, got {value!r}.")
    if hint is Path:
        if isinstance(value, str | Path):
            return Path(value).expanduser()
        raise ValueError(f"`{key}` must be a path, got {value!r}.")
    return value


# --- flat option files (every other command) --------------------------------------------------------------


def option_defaults(data: Mapping[str, Any], params, *, source: str) -> dict[str, Any]:
    """A flat file mapped onto a click command's parameters, for ``default_map``.

    Keys are option names as typed without the dashes (``join-timeout`` or ``join_timeout``, ``out`` for
    ``--out``) or argument names (``run_dir``).
    """
    by_key: dict[str, Any] = {}
    for p in params:
        if p.name in ("config_file", "help") or getattr(p, "hidden", False):
            continue
        by_key[p.name] = p
        for opt in getattr(p, "opts", []):
            if opt.startswith("--"):
                by_key[opt[2:].replace("-", "_")] = p
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        param = by_key.get(name)
        if param is None:
            msg = f"{source}: unknown key `{key}`. Valid keys: {', '.join(sorted(_shown_keys(params)))}."
            close = difflib.get_close_matches(name, by_key, n=1)
            if close:
                msg += f" Did you mean `{close[0]}`?"
            raise ConfigFileError(msg)
        if isinstance(value, Mapping):
            raise ConfigFileError(f"{source}: `{key}` must be a single value, got a mapping.")
        if isinstance(value, list) and not getattr(param, "multiple", False):
            value = ",".join(str(v) for v in value)  # e.g. gpus: [6, 7] -> "6,7"
        out[param.name] = value
    return out


def _shown_keys(params) -> list[str]:
    keys = []
    for p in params:
        if p.name in ("config_file", "help") or getattr(p, "hidden", False):
            continue
        longs = [o for o in getattr(p, "opts", []) if o.startswith("--")]
        keys.append(longs[0][2:].replace("-", "_") if longs and p.param_type_name == "option" else p.name)
    return keys


# --- field docs (the configuration reference) -------------------------------------------------------------


def field_docs(kind: type) -> dict[str, str]:
    """The docstrings written under each field of a dataclass (``x: int = 1`` then ``\"\"\"doc\"\"\"``)."""
    docs: dict[str, str] = {}
    for klass in reversed(kind.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs
