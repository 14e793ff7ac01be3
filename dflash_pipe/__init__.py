"""dflash-pipe: train DFlash speculative-decoding drafters online from a streaming target."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__version__ = "0.1.0"


def lazy_exports(package: str, namespace: dict[str, Any], exports: dict[str, str]) -> Callable[[str], Any]:
    """A package's ``__getattr__`` (PEP 562) that imports ``exports[name]`` (a submodule, ".x") on first use
    and keeps the value in ``namespace``: the package stays cheap to import (no torch or zmq until a name
    that needs them is used), and ``from package import Name`` works as with eager imports."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        namespace[name] = value
        return value

    return __getattr__
