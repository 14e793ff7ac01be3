"""The target's decoding engine: a static slot cache, CUDA-graphed decode steps, continuous batching.

Public API: ``SlotEngine`` (sessions in, turns decoded), ``DecodeStack`` (the model's layers over a
``SlotCache``), ``unsupported_reason(model)`` (why a family falls back to HF's forward), ``TurnRequest``,
``Session``, ``EngineStats``, ``GenerationStopped``.
"""

from dflash_pipe.target.decode.engine import EngineStats, GenerationStopped, Session, SlotEngine, TurnRequest
from dflash_pipe.target.decode.stack import DecodeStack, SlotCache, unsupported_reason

__all__ = [
    "DecodeStack",
    "EngineStats",
    "GenerationStopped",
    "Session",
    "SlotCache",
    "SlotEngine",
    "TurnRequest",
    "unsupported_reason",
]
