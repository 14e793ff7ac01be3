"""`dflash-pipe bench`: measurements a user runs on their own machine, each beside its baseline."""

from __future__ import annotations

from dflash_pipe import lazy_exports

# Names load on first use (PEP 562): importing one submodule never runs the others (no cycle through
# this file), and ``from dflash_pipe.bench import Name`` works as with eager imports.
_FROM = {
    ".result": ("BenchResult",),
}
_EXPORTS = {name: module for module, names in _FROM.items() for name in names}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
