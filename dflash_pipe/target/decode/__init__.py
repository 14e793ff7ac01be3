"""The target's decoding engine: a static slot cache, CUDA-graphed decode steps, continuous batching.

Public API: ``SlotEngine`` (sessions in, turns decoded), ``DecodeStack`` (the model's layers over a
``SlotCache``), ``unsupported_reason(model)`` (why a family falls back to HF's forward), ``TurnRequest``,
``Session``, ``EngineStats``, ``GenerationStopped``.
"""

from __future__ import annotations

from dflash_pipe import lazy_exports

# Names load on first use (PEP 562): importing one submodule never runs the others (no cycle through
# this file), and ``from dflash_pipe.target.decode import Name`` works as with eager imports.
_FROM = {
    ".engine": ("EngineStats", "GenerationStopped", "Session", "SlotEngine", "TurnRequest"),
    ".stack": ("DecodeStack", "SlotCache", "unsupported_reason"),
}
_EXPORTS = {name: module for module, names in _FROM.items() for name in names}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
