"""No code path of the package can run code hidden in data: the AST of every module is scanned for
pickle/marshal/eval/exec, torch.load without weights_only=True, np.load(allow_pickle=True) and pyzmq's
pickling send_pyobj/recv_pyobj (pickle over a socket is remote code execution)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dflash_pipe

PACKAGE = Path(dflash_pipe.__file__).resolve().parent
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
PICKLING_METHODS = {"send_pyobj", "recv_pyobj", "send_serialized", "recv_serialized"}


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.expr | None, value: bool) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _dotted(node: ast.expr) -> str:
    """`a.b.f` -> "a.b.f"; anything that is not a plain name chain -> "?"."""
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def _call_problem(call: ast.Call) -> str | None:
    name = _dotted(call.func)
    last = name.rsplit(".", 1)[-1]
    if name in ("eval", "exec", "compile", "__import__", "builtins.eval", "builtins.exec"):
        return f"{name}(...)"
    if last in PICKLING_METHODS:
        return f"{name}(...) pickles"
    is_torch_load = name.endswith("torch.load") or name == "torch.serialization.load"
    if is_torch_load and not _is_const(_keyword(call, "weights_only"), True):
        return f"{name}(...) without weights_only=True"
    if name in ("np.load", "numpy.load"):
        flag = _keyword(call, "allow_pickle")
        if flag is not None and not _is_const(flag, False):
            return f"{name}(..., allow_pickle=...)"
    return None


def violations(source: str, filename: str) -> list[str]:
    """Every unsafe deserialization construct in `source`, as "file:line: what"."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [
                f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES
            ]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] in FORBIDDEN_MODULES or (
                module == "torch" and any(a.name == "load" for a in node.names)
            ):
                found.append(f"{where}: from {module} import ...")
        elif isinstance(node, ast.Call) and (problem := _call_problem(node)):
            found.append(f"{where}: {problem}")
    return found


def test_package_has_no_unsafe_deserialization():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 30
    found = [v for f in files for v in violations(f.read_text(), str(f.relative_to(PACKAGE.parent)))]
    assert not found, (
        "unsafe deserialization (use msgpack/json/safetensors, weights_only=True):\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import pickle as p",
        "from pickle import loads",
        "import marshal",
        "from cloudpickle import dumps",
        "eval(text)",
        "builtins.exec(code)",
        "torch.load(path)",
        "torch.load(path, weights_only=False)",
        "torch.load(path, map_location='cpu', weights_only=flag)",
        "np.load(path, allow_pickle=True)",
        "sock.send_pyobj(obj)",
        "obj = sock.recv_pyobj()",
        "__import__('os')",
        "from torch import load",
        "compile(src, 'f', 'exec')",
    ],
)
def test_scanner_catches(snippet: str):
    assert violations(snippet, "x.py"), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "model.eval()",
        "torch.load(path, map_location='cpu', weights_only=True)",
        "np.load(path)",
        "np.load(path, allow_pickle=False)",
        "json.loads(text)",
        "msgpack.unpackb(buf, raw=False)",
    ],
)
def test_scanner_allows(snippet: str):
    assert not violations(snippet, "x.py"), snippet
