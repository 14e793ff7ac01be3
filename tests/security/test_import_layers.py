"""The package is one house in layers: a module imports only its own layer and the layers below it.

Bottom to top: the protocol (``wire``), what every part reads (telemetry, the data inputs), the run formats
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
    ("protocol", ("wire",)),
    ("support", ("telemetry", "data")),
    (
        "formats",
        (
            "config",
            "config_file",
            "layout",
            "train.checkpoint",
            "train.ledger",
            "producer.record",
            "drafter.config",
            "drafter.presets",
            "train.config",
        ),
    ),
    ("compute policy", ("compute",)),
    ("target", ("target",)),
    ("drafter", ("drafter",)),
    ("training step", ("train",)),
    (
        "processes",
        ("producer", "train.worker", "train.link", "train.loop", "train.threads", "launcher", "regenerate"),
    ),
    ("command line", ("", "cli", "launch_options", "reference", "report", "bench", "__main__")),
)
"""Bottom first. A module's layer is the one holding the longest prefix of its dotted name (below
``dflash_pipe``): ``drafter.config`` is a run format although ``drafter`` is compute; "" is the root
package itself."""

KNOWN: set[tuple[str, str]] = {
    ("dflash_pipe.drafter.config", "dflash_pipe.drafter.rope"),
    ("dflash_pipe.target.core", "dflash_pipe.drafter.compile_guard"),
    ("dflash_pipe.target.families", "dflash_pipe.drafter.compile_guard"),
}
"""(module, imported module) pairs that break the layering today; remove an entry when you fix it. The
test fails on an entry that no longer occurs, so the list only shrinks."""


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
    found = layer_violations()
    new = [text for module, imported, text in found if (module, imported) not in KNOWN]
    assert not new, "imports of a higher layer (move the code down, or the import up):\n" + "\n".join(new)


def test_known_violations_still_occur() -> None:
    occurring = {(module, imported) for module, imported, _ in layer_violations()}
    fixed = sorted(KNOWN - occurring)
    assert not fixed, f"fixed, so remove from KNOWN: {fixed}"


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
