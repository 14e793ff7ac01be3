"""The package is one house in layers: a module imports only its own layer and the layers below it.

Bottom to top: the protocol (``wire``), what every part reads (telemetry, the data inputs, the field
metadata the configs declare their flags with), the parts' config sections (``config``: drafter shape,
presets, MASK token, RoPE check, training hyper-parameters), the run formats (the run config joining those
sections, layout, checkpoint, ledger, producer record), compute (the shared compile
and precision policy, then the target, the drafter, the training step), the processes (producer, worker,
the worker pool, launcher) and the command line on top. Every import counts, the ones inside functions and under
``TYPE_CHECKING`` too: a lazy import of a higher layer is still a dependency on it. The AST of every module
is read, nothing is imported, so a violation is named by file, line and import.

No import cycles either, between modules or between packages (a package is a first dotted component, see
``package_of``): a cycle is a pair of files a reader cannot read one before the other, and it hides from the layers when both ends sit in one layer. Tarjan's algorithm finds each
strongly connected component; the failure lists its members and one shortest loop in it, with the file and
line of every import on the way. ``TYPE_CHECKING`` imports count here too: a type a module names is one the
reader must look up, and the fix is the same (a small Protocol, or the type moved down to where both ends
can import it). A name a package exports lazily (``lazy_exports``) counts as an import of the submodule
that defines it, since that is what loads. Between modules, the implicit import of a module's parent
``__init__`` (Python runs it first) is an edge too: an ``__init__`` that imported its submodules eagerly
would be a cycle with each of them, so every package exports lazily. Between packages it is not (the
``__init__`` belongs to its package).
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

import dflash_pipe

PACKAGE = Path(dflash_pipe.__file__).resolve().parent
NAME = "dflash_pipe"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("protocol", ("", "wire")),
    ("support", ("telemetry", "data", "fields", "diskspace", "cpus")),
    ("config sections", ("config",)),
    ("formats", ("run",)),
    ("compute policy", ("compute",)),
    ("target", ("target",)),
    ("drafter", ("drafter",)),
    ("training step", ("train",)),
    ("processes", ("producer", "worker", "worker_pool", "launcher", "regenerate")),
    ("command line", ("cli", "commands", "reference", "report", "bench", "__main__")),
)
"""Bottom first. A module's layer is the one holding the longest prefix of its dotted name (below
``dflash_pipe``); every layer is whole packages (no submodule of a higher package sits in a lower layer:
the sections ``run.config`` joins live in ``config``, below it); "" is the root package itself
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


def _lazy_exports(path: Path, package: str) -> dict[str, str]:
    """Name -> submodule of a package ``__init__`` that exports lazily (``lazy_exports`` over an
    ``_EXPORTS`` or ``_FROM`` literal): ``from package import Name`` loads that submodule on first use,
    so the import depends on it, not on the (import-free) ``__init__``."""
    exports: dict[str, str] = {}
    for node in ast.parse(path.read_text(), str(path)).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target = node.targets[0]
        if not isinstance(target, ast.Name) or not isinstance(node.value, ast.Dict):
            continue
        if target.id == "_EXPORTS":
            exports |= ast.literal_eval(node.value)
        elif target.id == "_FROM":
            exports |= {n: mod for mod, names in ast.literal_eval(node.value).items() for n in names}
    return {name: package + mod if mod.startswith(".") else mod for name, mod in exports.items()}


def _init_of(module: str) -> Path:
    return PACKAGE.joinpath(*module.split(".")[1:], "__init__.py")


def _imports(module: str, path: Path, known_modules: set[str]) -> list[tuple[int, str]]:
    """(line, imported module of this package) for every import in ``path``; a name a package exports
    lazily counts as an import of the submodule that defines it."""
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
            lazy = _lazy_exports(_init_of(source), source) if _init_of(source).is_file() else {}
            for alias in node.names:  # `from pkg import submodule` depends on the submodule
                sub = f"{source}.{alias.name}"
                out.append((node.lineno, sub if sub in known_modules else lazy.get(alias.name, source)))
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


Graph = dict[str, dict[str, str]]
"""node -> {node it imports: "file:line" of one such import}."""


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node (or one node importing itself), each
    sorted, the list sorted: every import cycle lies inside exactly one of them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, {}):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def shortest_cycle(graph: Graph, component: list[str]) -> list[str]:
    """A shortest cycle through the component's first node, as [a, b, ..., a] (breadth first inside it)."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph.get(node, {})):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if nxt in members and nxt not in came_from:
                    came_from[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"{component} is no cycle")


def describe_cycles(graph: Graph) -> list[str]:
    """One paragraph per component: its members, then one cycle in it with the import behind each step."""
    out = []
    for component in strongly_connected(graph):
        cycle = shortest_cycle(graph, component)
        steps = [f"  {graph[a][b]}: {a} -> {b}" for a, b in itertools.pairwise(cycle)]
        out.append(f"{len(component)} in a cycle: {', '.join(component)}\n" + "\n".join(steps))
    return out


def _short(module: str) -> str:
    return module.removeprefix(NAME + ".") or NAME


def module_graph(*, parents: bool = True) -> Graph:
    """Every module of the package (named below ``dflash_pipe``) with the modules it imports; ``parents``:
    and with its parent package's ``__init__``, which Python runs before it."""
    modules = _modules()
    graph: Graph = {_short(m): {} for m in modules}
    for module, path in modules.items():
        for line, imported in _imports(module, path, set(modules)):
            where = f"{path.relative_to(PACKAGE.parent)}:{line}"
            graph[_short(module)].setdefault(_short(imported), where)
        parent = module.rpartition(".")[0]
        if parents and parent in modules:
            where = f"{path.relative_to(PACKAGE.parent)}:0 (its package's __init__ runs first)"
            graph[_short(module)].setdefault(_short(parent), where)
    return graph


def package_of(module: str) -> str:
    """The package node of a module: its first dotted component (``target`` for ``target.decode.stack``; a
    module at the top such as ``launcher`` is its own node). Every layer is whole packages, so no prefix
    is a node of its own. A subpackage is no node either: ``target.decode`` sits between target's base
    modules (layers, packing) and ``target.generate``, a layering inside one package that the module graph
    checks; as a node it would count as a cycle with ``target`` and ask to split the package for no reader's
    sake."""
    return module.split(".")[0]


def package_graph(modules: Graph) -> Graph:
    """The module graph with each module folded into its ``package_of``; imports inside a node drop out."""
    graph: Graph = {}
    for module, imports in modules.items():
        mine = package_of(module)
        graph.setdefault(mine, {})
        for imported, where in imports.items():
            theirs = package_of(imported)
            if theirs != mine:
                graph[mine].setdefault(theirs, f"{where} ({module} -> {imported})")
    return graph


def test_no_import_cycles_between_modules() -> None:
    found = describe_cycles(module_graph())
    assert not found, (
        "modules that import each other, directly or round a loop (move the shared part into a module both "
        "import, or type against a Protocol):\n" + "\n".join(found)
    )


def test_no_import_cycles_between_packages() -> None:
    found = describe_cycles(package_graph(module_graph(parents=False)))
    assert not found, "packages that import each other (move the shared code below both):\n" + "\n".join(
        found
    )


SYNTHETIC: Graph = {
    "a": {"b": "a.py:1"},
    "b": {"c": "b.py:1", "d": "b.py:2"},
    "c": {"a": "c.py:1"},
    "d": {"e": "d.py:1"},
    "e": {},
    "f": {"f": "f.py:1"},
    "g": {"h": "g.py:1"},
    "h": {"g": "h.py:1", "a": "h.py:2"},
}
"""a -> b -> c -> a is one loop (b's way out to d -> e is none), f imports itself, g <-> h is a second loop
that leads into the first without being part of it."""


def test_the_cycle_finder_on_a_small_graph() -> None:
    assert strongly_connected(SYNTHETIC) == [["a", "b", "c"], ["f"], ["g", "h"]]
    assert shortest_cycle(SYNTHETIC, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert shortest_cycle(SYNTHETIC, ["f"]) == ["f", "f"]
    first = describe_cycles(SYNTHETIC)[0]
    assert first.splitlines() == [
        "3 in a cycle: a, b, c",
        "  a.py:1: a -> b",
        "  b.py:1: b -> c",
        "  c.py:1: c -> a",
    ]


def test_the_cycle_finder_sees_no_cycle_in_a_tree() -> None:
    tree: Graph = {"a": {"b": "", "c": ""}, "b": {"c": ""}, "c": {}}
    assert strongly_connected(tree) == []


def test_packages_group_modules_by_their_first_component() -> None:
    assert package_of("target.decode.stack") == "target"
    assert package_of("config.drafter") == "config"
    assert package_of("drafter.model") == "drafter"
    assert package_of("launcher") == "launcher"
    graph = package_graph({"run.config": {"config.presets": "x:1"}, "drafter.model": {"run.files": "y:2"}})
    assert graph == {
        "run": {"config": "x:1 (run.config -> config.presets)"},
        "drafter": {"run": "y:2 (drafter.model -> run.files)"},
    }
    assert strongly_connected(graph) == []


def test_every_layer_is_whole_packages() -> None:
    """No submodule of a higher package sits in a lower layer (the config sections moved to ``config``)."""
    assert all("." not in prefix for _, prefixes in LAYERS for prefix in prefixes)


def test_a_module_depends_on_its_package_init_which_imports_nothing_eagerly() -> None:
    graph = module_graph()
    assert "target.decode" in graph["target.decode.stack"] and "data" in graph["data.sources"]
    eager = {m: sorted(i) for m, i in graph.items() if _modules()[f"{NAME}.{m}" if m != NAME else NAME].name
             == "__init__.py" and any(i.startswith(m + ".") for i in graph[m])}  # fmt: skip
    assert not eager, f"package __init__ files that import their own submodules (export them lazily): {eager}"


def test_a_lazily_exported_name_is_an_import_of_its_submodule(tmp_path: Path) -> None:
    path = tmp_path / "probe.py"
    path.write_text("from dflash_pipe.drafter import DrafterConfig\nfrom dflash_pipe.wire import Batch\n")
    got = _imports("dflash_pipe.wire.probe", path, set(_modules()))
    assert [name for _, name in got] == ["dflash_pipe.config.drafter", "dflash_pipe.wire.messages"]
