"""The package is one house in layers: a module imports only its own layer and the layers below it.

Bottom to top: the protocol (``wire``), what every part reads (telemetry, the data inputs, the field
metadata the configs declare their flags with), the run formats
(run config, layout, checkpoint, ledger, producer record, the part configs), compute (the shared compile
and precision policy, then the target, the drafter, the training step), the processes (producer, worker,
launcher) and the command line on top. Every import counts, the ones inside functions and under
``TYPE_CHECKING`` too: a lazy import of a higher layer is still a dependency on it. The AST of every module
is read, nothing is imported, so a violation is named by file, line and import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dflash_pipe

PACKAGE = Path(dflash_pipe.__file__).resolve().parent
NAME = "dflash_pipe"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("protocol", ("", "wire")),
    ("support", ("telemetry", "data", "fields", "diskspace")),
    (
        "formats",
        ("run", "drafter.config", "drafter.rope", "drafter.presets", "train.config"),
    ),
    ("compute policy", ("compute",)),
    ("target", ("target",)),
    ("drafter", ("drafter",)),
    ("training step", ("train",)),
    ("processes", ("producer", "worker", "launcher", "regenerate")),
    ("command line", ("cli", "commands", "reference", "report", "bench", "__main__")),
)
"""Bottom first. A module's layer is the one holding the longest prefix of its dotted name (below
``dflash_pipe``): the part configs are run formats although their packages are compute (``drafter.rope``
with them: a drafter config is valid when its RoPE parameters build); "" is the root package itself
(the version and the lazy-export helper every package's ``__init__`` uses: below everything)."""

PEERS = (("producer",), ("train", "worker"))
"""Packages that talk only through the protocol and the run formats: neither imports the other (the
producer reads a checkpoint's ledger through ``run``, not through the worker's code)."""


def _rank(module: str) -> tuple[int, str]:
    rel = module.removeprefix(NAME).removeprefix(".")
    best: tuple[int, int, str] | None = None  # (prefix length, rank, layer name)
    for rank, (layer, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = rel == prefix or (prefix and rel.startswith(prefix + "."))
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), rank, layer)
    assert best is not None, f"{module} matches no layer; add it to LAYERS"
    return best[1], best[2]


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = (NAME, *path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(module: str, path: Path, known_modules: set[str]) -> list[tuple[int, str]]:
    """(line, imported module of this package) for every import in ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == NAME]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != NAME:
                continue
            for alias in node.names:  # `from pkg import submodule` depends on the submodule
                sub = f"{source}.{alias.name}"
                out.append((node.lineno, sub if sub in known_modules else source))
    return sorted(set(out))


def layer_violations() -> list[tuple[str, str, str]]:
    """(module, imported module, "file:line: ...") for every import of a higher layer."""
    modules = _modules()
    found = []
    for module, path in modules.items():
        rank, layer = _rank(module)
        for line, imported in _imports(module, path, set(modules)):
            their_rank, their_layer = _rank(imported)
            if their_rank > rank:
                where = f"{path.relative_to(PACKAGE.parent)}:{line}"
                found.append(
                    (module, imported, f"{where}: {module} ({layer}) imports {imported} ({their_layer})")
                )
    return found


def test_no_module_imports_a_higher_layer() -> None:
    found = [text for _, _, text in layer_violations()]
    assert not found, "imports of a higher layer (move the code down, or the import up):\n" + "\n".join(found)


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    rel = module.removeprefix(NAME + ".")
    return any(rel == p or rel.startswith(p + ".") for p in prefixes)


def test_the_producer_and_the_worker_do_not_import_each_other() -> None:
    modules = _modules()
    found = []
    for module, path in modules.items():
        for mine, theirs in (PEERS, PEERS[::-1]):
            if not _under(module, mine):
                continue
            found += [
                f"{path.relative_to(PACKAGE.parent)}:{line}: {module} imports {imported}"
                for line, imported in _imports(module, path, set(modules))
                if _under(imported, theirs)
            ]
    assert not found, "the producer and the worker share only wire/ and run/:\n" + "\n".join(found)


def test_every_module_has_a_layer() -> None:
    for module in _modules():
        _rank(module)  # asserts


@pytest.mark.parametrize(
    ("source", "imported", "expected"),
    [
        ("from dflash_pipe.producer.staging import HostSlot\n", "dflash_pipe.producer.staging", True),
        ("def f():\n    from dflash_pipe.cli import main\n", "dflash_pipe.cli", True),
        ("from dflash_pipe.wire import messages as m\n", "dflash_pipe.wire.messages", False),
    ],
)
def test_the_scan_sees_top_level_and_lazy_imports(
    tmp_path: Path, source: str, imported: str, expected: bool
) -> None:
    """The scanner on a module of the protocol layer: it must flag a higher import wherever it sits."""
    path = tmp_path / "probe.py"
    path.write_text(source)
    modules = set(_modules())
    got = _imports("dflash_pipe.wire.probe", path, modules)
    assert [name for _, name in got] == [imported]
    assert (_rank(imported)[0] > _rank("dflash_pipe.wire.probe")[0]) is expected
