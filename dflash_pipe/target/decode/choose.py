"""Which slot stack decodes a target, decided in one place for regeneration and the producer."""

from __future__ import annotations

from typing import Any

from torch import nn

from dflash_pipe.target.decode.hybrid import HYBRID_FAMILIES, HybridStack, hybrid_unsupported_reason
from dflash_pipe.target.decode.stack import DecodeStack, unsupported_reason


def engine_refusal(model: nn.Module, decoder: str) -> str | None:
    """Why ``model`` decodes on the plain path under ``regen.decoder`` = ``decoder`` (None: the slot engine
    takes it). "auto" and "engine" take the same families: dense and MoE Qwen/Llama/Mistral targets and the
    Qwen3.5/3.6 and Qwen3-Next hybrids, whose greedy fp32 turns equal HF ``generate`` on CPU and on an
    H200 (tests/target/test_decode_hybrid*.py)."""
    if decoder == "plain":
        return "--regen-decoder plain asks for it"
    dense, hybrid = unsupported_reason(model), hybrid_unsupported_reason(model)
    if dense is None or hybrid is None:
        return None
    family = getattr(getattr(model, "config", None), "model_type", None)
    return hybrid if family in HYBRID_FAMILIES else dense


def build_stack(model: nn.Module, max_len: int) -> Any:
    """The stack for a model ``engine_refusal`` accepted: ``DecodeStack`` or ``HybridStack``."""
    if unsupported_reason(model) is None:
        return DecodeStack(model, max_len=max_len)
    return HybridStack(model, max_len=max_len)
