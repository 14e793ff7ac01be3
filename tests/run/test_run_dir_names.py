"""No module outside ``run/`` spells a name of the run directory: it asks ``RunDir``.

The names are read from ``run.files.NAMES`` (what ``RunDir`` builds its paths from), not copied here, so a
name added there is guarded at once. Every module's AST is read, nothing is imported; docstrings are prose
and do not count. A violation is named by file, line and name.

What counts as spelling a name:

- a string equal to a name that looks like a file (``metrics.jsonl``, ``owner.json``, ``compile-cache``);
- an f-string joining a name onto a value as a path (``f"{run_dir}/checkpoints/latest"``);
- a bare word (``checkpoints``, ``logs``, ``samples``) only where it is used as a path: joined with ``/``,
  given to ``Path()`` or ``joinpath``, or a module constant's value. Elsewhere it is an ordinary word (a
  dict key ``"samples"``, the sink kind ``"tensorboard"``);
- ``config.json`` only where it is joined onto a run dir (an expression naming ``run``): it is also the
  config file of every Hugging Face model directory, the target's and an export's, which are not the
  run dir's.

Prose that describes the layout (a help text's ``RUN_DIR/report/``) is not a path and does not count.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import dflash_pipe
from dflash_pipe.run.files import CONFIG_FILE, NAMES

PACKAGE = Path(dflash_pipe.__file__).resolve().parent
OWNER = PACKAGE / "run"


def _filelike(name: str) -> bool:
    return bool(re.search(r"[._-]", name))


def _joined_on(text: str) -> set[str]:
    """The path segments an f-string part starting with ``/`` joins onto the value before it
    (``/checkpoints/latest at`` -> checkpoints, latest)."""
    match = re.match(r"/[\w.\-/]*", text)
    return {part for part in match.group().split("/") if part} if match else set()


def _fstring_parts(tree: ast.AST) -> dict[int, bool]:
    """id of each literal part of an f-string -> whether it follows a formatted value."""
    out: dict[int, bool] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            for i, part in enumerate(node.values):
                if isinstance(part, ast.Constant):
                    out[id(part)] = i > 0 and isinstance(node.values[i - 1], ast.FormattedValue)
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string statements (module, class, function and attribute docstrings)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }


def _as_path(tree: ast.AST) -> dict[int, ast.AST]:
    """id of each string used as a path -> the expression it is joined onto (or itself)."""
    out: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            out[id(node.right)] = node.left
            out[id(node.left)] = node.left
        elif isinstance(node, ast.Call):
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            if name in ("Path", "joinpath", "with_name", "PurePath"):
                for arg in node.args:
                    out[id(arg)] = func.value if isinstance(func, ast.Attribute) else arg
        elif (
            isinstance(node, ast.Assign)
            and node in getattr(tree, "body", [])
            and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets)
        ):
            out[id(node.value)] = node.value
    return out


def spelled_names(source: str, filename: str, names: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, name) for every run-dir name ``source`` spells, by the rules of this module's docstring."""
    tree = ast.parse(source, filename)
    prose, paths, parts = _docstrings(tree), _as_path(tree), _fstring_parts(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in prose:
            continue
        text = node.value
        whole = id(node) not in parts  # a string of its own, not a piece of an f-string
        joined_on = _joined_on(text) if parts.get(id(node)) else set()
        for name in names:
            if name == CONFIG_FILE:
                onto = paths.get(id(node))
                hit = whole and text == name and onto is not None and "run" in ast.unparse(onto).lower()
            elif _filelike(name):
                hit = (whole and text == name) or name in joined_on
            else:
                hit = (whole and text == name and id(node) in paths) or name in joined_on
            if hit:
                found.append((node.lineno, name))
    return sorted(found)


def test_no_module_outside_run_spells_a_run_dir_name() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if OWNER in path.parents:
            continue
        where = path.relative_to(PACKAGE.parent)
        found += [
            f"{where}:{line}: {name!r}" for line, name in spelled_names(path.read_text(), str(path), NAMES)
        ]
    assert not found, "run-dir names spelled outside run/ (ask RunDir for the path):\n" + "\n".join(found)


def test_the_scan_finds_each_way_of_spelling_a_name() -> None:
    """The rules catch what they say and leave prose, dict keys and model directories alone."""
    source = '''"""RUN_DIR/metrics.jsonl in a docstring is prose."""
LOGS = "logs"
a = run_dir / "metrics.jsonl"
b = f"{run_dir}/checkpoints/latest"
c = cfg.run_dir / "config.json"
d = Path(root, "samples")
e = {"samples": 3, "kind": "tensorboard"}
f = target_path / "config.json"
g = "owner.json"
h = f".{name}.lock and RUN_DIR/logs in a message"
KINDS = ("jsonl", "tensorboard")
'''
    assert spelled_names(source, "example.py", NAMES) == sorted(
        [
            (2, "logs"),
            (3, "metrics.jsonl"),
            (4, "checkpoints"),
            (4, "latest"),
            (5, "config.json"),
            (6, "samples"),
            (9, "owner.json"),
        ]
    )
