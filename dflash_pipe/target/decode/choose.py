"""Which slot stack decodes a target, decided in one place for regeneration and the producer."""

from __future__ import annotations

from typing import Any

from torch import nn

from dflash_pipe.target.decode.hybrid import HybridStack, hybrid_unsupported_reason
from dflash_pipe.target.decode.stack import DecodeStack, unsupported_reason


def engine_refusal(model: nn.Module, decoder: str) -> str | None:
    """Why ``model`` decodes on the plain path under ``regen.decoder`` = ``decoder`` (None: the slot engine
    takes it). Hybrids take it only with "engine": their stack equals HF ``generate`` on CPU and runs on
    an H200 (2.5K tokens/s at the 27B width, batch 64), but its replies are not yet checked there."""
    if decoder == "plain":
        return "--regen-decoder plain asks for it"
    reason = unsupported_reason(model)
    if reason is None or hybrid_unsupported_reason(model) is not None:
        return reason
    if decoder != "engine":
        return "hybrid targets take the slot engine only with --regen-decoder engine (not yet checked against HF on a GPU)"
    return None


def build_stack(model: nn.Module, max_len: int) -> Any:
    """The stack for a model ``engine_refusal`` accepted: ``DecodeStack`` or ``HybridStack``."""
    if unsupported_reason(model) is None:
        return DecodeStack(model, max_len=max_len)
    return HybridStack(model, max_len=max_len)
