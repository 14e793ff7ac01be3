"""The producer's state is written only by its owners: ``Peers`` (and the ``Peer`` records in it),
``Leasing`` and ``Accounting``. Everything else reads their fields and calls their methods.

The check reads the code: a write through a reference (``core.account.step = ...``, ``peer.credits -= 1``,
``core.peers.lost.append(...)``, ``account.sent_by_ref["shm"] += 1``) to a field one of them owns is a
finding anywhere but in the owner's own methods. Writes to ``self.x`` are a class's own business and are
not looked at. Modules that never import the producer are skipped: their ``.step`` or ``.state`` are other
classes' fields.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCER = ROOT / "dflash_pipe" / "producer"
OWNERS = {"Peers": "peers.py", "Leasing": "leasing.py", "Accounting": "accounting.py"}
RECORDS = {"Peer": "Peers", "GroupWait": "Peers"}
"""Dataclasses whose instances an owner keeps: only that owner writes their fields."""
MUTATORS = frozenset({"append", "extend", "insert", "pop", "clear", "update", "remove", "add", "discard"})


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def owned_fields() -> dict[str, set[str]]:
    """Field name -> the owners that hold a field of that name."""
    owned: dict[str, set[str]] = {}
    for owner, file in OWNERS.items():
        for node in ast.walk(_class(ast.parse((PRODUCER / file).read_text()), owner)):
            target = node.target if isinstance(node, ast.AnnAssign) else None
            targets = node.targets if isinstance(node, ast.Assign) else [target] if target else []
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    owned.setdefault(t.attr, set()).add(owner)
    for record, owner in RECORDS.items():
        tree = ast.parse((PRODUCER / OWNERS[owner]).read_text())
        for node in _class(tree, record).body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                owned.setdefault(node.target.id, set()).add(owner)
    return owned


def _written(node: ast.AST) -> list[ast.Attribute]:
    """The attributes a statement writes through a reference (not ``self.x`` itself)."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = node.targets
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in MUTATORS
        and isinstance(node.func.value, ast.Attribute)
    ):
        targets = [node.func.value]
    else:
        return []
    found = []
    for target in targets:
        for t in ast.walk(target) if isinstance(target, ast.Tuple) else [target]:
            while isinstance(t, ast.Subscript):
                t = t.value
            if isinstance(t, ast.Attribute) and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                found.append(t)
    return found


def findings(source: str, path: str, owned: dict[str, set[str]]) -> list[str]:
    """``path:line: expression`` for each write to an owned field outside its owner's methods."""
    tree = ast.parse(source)
    out = []

    def visit(node: ast.AST, owner: str | None) -> None:
        if isinstance(node, ast.ClassDef) and OWNERS.get(node.name) == Path(path).name:
            owner = node.name
        for attr in _written(node):
            owners = owned.get(attr.attr, set())
            if owners and owner not in owners:
                out.append(f"{path}:{attr.lineno}: {ast.unparse(attr)}")
        for child in ast.iter_child_nodes(node):
            visit(child, owner)

    visit(tree, None)
    return out


def _modules() -> list[Path]:
    """The producer's modules and every module that imports one of them."""
    paths = sorted([*(ROOT / "dflash_pipe").rglob("*.py"), *(ROOT / "bench").rglob("*.py")])
    return [p for p in paths if p.parent == PRODUCER or "dflash_pipe.producer" in p.read_text()]


def test_only_the_owners_write_the_producers_state():
    owned = owned_fields()
    assert {"step", "lost", "credits", "done_sent", "eval_pending", "group_wait"} <= set(owned)
    found = [f for p in _modules() for f in findings(p.read_text(), str(p.relative_to(ROOT)), owned)]
    assert not found, (
        "the producer's state written outside its owner (call the owner's method):\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    ("code", "written"),
    [
        ("core.account.step = 3", "core.account.step"),
        ("self.core.leases.eval_pending = True", "self.core.leases.eval_pending"),
        ("peer.credits -= 1", "peer.credits"),
        ("core.peers.lost.append('x')", "core.peers.lost"),
        ("core.account.sent_by_ref['shm'] += 1", "core.account.sent_by_ref"),
        ("a, core.peers.redirected = 1, 2", "core.peers.redirected"),
    ],
)
def test_the_check_finds_a_write_through_a_reference(code: str, written: str):
    found = findings(code, "dflash_pipe/producer/core.py", owned_fields())
    assert found == [f"dflash_pipe/producer/core.py:1: {written}"]


def test_the_peer_table_answers_in_by_identity():
    """``b"id" in core.peers`` asks about an identity, as it did of the dict: never about the records."""
    from dflash_pipe.producer.peers import Peer, Peers

    peers = Peers()
    peers.add(Peer(identity=b"w", name="w", device="cpu", host="h", pid=1))
    assert b"w" in peers and b"x" not in peers and len(peers) == 1


def test_the_owner_writes_its_own_records_and_self_is_left_alone():
    owned = owned_fields()
    inside = (
        "class Peers:\n    def f(self, peer):\n        peer.credits -= 1\n        self.lost.append('x')\n"
    )
    assert findings(inside, "dflash_pipe/producer/peers.py", owned) == []
    other = "class Leasing:\n    def f(self, peer):\n        peer.credits -= 1\n"
    assert findings(other, "dflash_pipe/producer/leasing.py", owned) == [
        "dflash_pipe/producer/leasing.py:3: peer.credits"
    ]
