"""Target families: which transformers class loads a checkpoint, which attention it runs, and whether its
samples may share a packed row.

Decided once, when a ``TargetCore`` is built (``plan_target`` from the config alone, so a launch can refuse
a target before anything loads; ``check_loaded`` once the weights are in):

- **Loader.** ``AutoModelForCausalLM`` when transformers has a causal LM for the config. A multimodal
  checkpoint whose config has none (Kimi-K2.5) loads through its own wrapper class
  (``AutoModelForImageTextToText``: transformers' own weight renames for that checkpoint apply, which
  differ between versions). Anything else is refused, naming the model type. A multimodal wrapper (Kimi's,
  Gemma 3's) then frees what a text-only forward never runs (``keep_language_model``).
- **Attention implementation.** A model class that refuses SDPA (gpt-oss: its attention sinks) runs
  transformers' eager attention, which implements them.
- **Packing.** A family whose packed rows transformers cannot keep apart runs right-padded rows instead
  (``PADDED_FAMILIES``, with the reason in one log line). Every target is then probed on a two-sample row:
  features before a position must not depend on the token there (else it is not a causal LM and is
  refused), and in a packed row one sample's features must not depend on another sample's tokens (else the
  target falls back to padded rows, with one log line). Those probes guard the families and transformers
  versions that the coverage test (tests/target/test_family_coverage.py) has not seen.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dflash_pipe.target.packing import Packing

log = logging.getLogger("dflash_pipe.target")

PADDED_FAMILIES: dict[str, str] = {
    "gpt_oss": (
        "GptOssModel builds its attention masks without the position ids, so transformers cannot see where "
        "the samples of a packed row start (measured: 50-66% relative error on every sample after the "
        "first); it runs right-padded rows with eager attention (the only transformers attention on CPU and "
        "without the kernels package that computes its attention sinks)"
    ),
}
"""model_type -> why its samples must not share a row (the log line says so)."""

PROBE_LENGTH = 72
"""Tokens per probe sample. Two of them fill more than one 128-token flex tile, the length class real batches
compile for (a shorter probe would compile variants of the target's layers that no batch needs), and
exceed a causal conv's window (4)."""


class UnsupportedTargetError(ValueError):
    """The target checkpoint is not a model dflash-pipe can take features from; the message says why."""


@dataclass(frozen=True, slots=True)
class TargetPlan:
    """How one target checkpoint is loaded and run."""

    model_type: str
    loader: Any
    """The transformers auto class that loads it (AutoModelForCausalLM or AutoModelForImageTextToText)."""
    attn_implementation: str | None
    """An implementation the model class needs (eager for gpt-oss), or None: TargetCore picks flex/sdpa."""
    padded_reason: str | None
    """Why packed rows are not exact for this family (it runs padded), or None."""

    @property
    def wrapper(self) -> bool:
        """Loaded through a multimodal wrapper (no causal-LM class): only its language model is kept."""
        return self.loader.__name__ != "AutoModelForCausalLM"


def plan_target(config: Any) -> TargetPlan:
    """The loader, attention and packing of a target from its config; ``UnsupportedTargetError`` if none."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto import modeling_auto

    model_type = str(getattr(config, "model_type", "") or type(config).__name__)
    causal = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    wrappers = modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    text_type = str(getattr(text, "model_type", ""))
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedTargetError(
            f"target model type {model_type!r} is an encoder-decoder model; dflash-pipe trains drafters for "
            "decoder-only causal LMs (Qwen, Llama, gpt-oss, DeepSeek, ...). Point --target-model at one"
        )
    if model_type in causal:
        loader, class_name = AutoModelForCausalLM, causal[model_type]
    elif model_type in wrappers and text is not config and text_type in causal:
        loader, class_name = AutoModelForImageTextToText, wrappers[model_type]
    else:
        raise UnsupportedTargetError(
            f"target model type {model_type!r} has no causal-LM class in this transformers "
            f"(and no multimodal wrapper around a causal text model); dflash-pipe needs a decoder-only LM. "
            "Point --target-model at one, or upgrade transformers if a newer one supports this model"
        )
    import transformers

    attn = None
    model_class = getattr(transformers, class_name, None)
    if model_class is not None and getattr(model_class, "_supports_sdpa", True) is False:
        attn = "eager"  # e.g. gpt-oss: SDPA has no attention sinks
    reason = PADDED_FAMILIES.get(model_type) or PADDED_FAMILIES.get(text_type)
    return TargetPlan(model_type=model_type, loader=loader, attn_implementation=attn, padded_reason=reason)


_NON_TEXT = re.compile(r"vision|visual|audio|image|video|projector|mm_|multi_modal", re.I)
"""Names of a multimodal wrapper's parts that a text-only forward never runs."""


def keep_language_model(model: Any) -> list[str]:
    """Frees what a multimodal wrapper loaded besides its language model (vision tower, projector: a
    text-only forward never runs them) and returns their names; a no-op for a plain causal LM. Only parts of
    the wrapper's base model whose names say they are not text are freed; the LM head and the language
    model's embeddings stay."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    base = getattr(model, "model", None)
    if decoder is None or base is None or decoder is base:
        return []
    dropped = [n for n, child in base.named_children() if child is not decoder and _NON_TEXT.search(n)]
    for name in dropped:
        setattr(base, name, None)
    return dropped


def describe_target(config: Any) -> str:
    """One line on a target from its config (``launch --dry-run``): family, shape, layer types, and how it
    runs; ``UnsupportedTargetError`` for a target a launch refuses."""
    plan = plan_target(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    parts = [str(getattr(text, "model_type", plan.model_type))]
    if plan.wrapper:
        parts[0] += f" (the text model of the multimodal {plan.model_type})"
    layers = getattr(text, "num_hidden_layers", "?")
    parts.append(f"{layers} layers, hidden {getattr(text, 'hidden_size', '?')}")
    types = list(getattr(text, "layer_types", None) or [])
    if types:
        counts = {t: types.count(t) for t in dict.fromkeys(types)}
        parts.append(" + ".join(f"{n} {t}" for t, n in counts.items()))
    if plan.padded_reason:
        parts.append(
            "runs right-padded rows"
            + (f", {plan.attn_implementation} attention" if plan.attn_implementation else "")
        )
    else:
        parts.append("runs packed rows (checked on a probe when it loads)")
    return "; ".join(parts)


class LoadedTarget(Protocol):
    """What the load-time probe reads and switches on a target (a ``TargetCore`` is one): typed here so the
    core, which runs the probe, imports this module without it importing the core back."""

    model_path: str
    plan: TargetPlan
    dtype: torch.dtype
    packing: Packing
    hidden_size: int
    vocab_size: int
    layer_ids: tuple[int, ...]

    def features(self, input_ids: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor: ...

    def use_padded(self) -> None: ...


def check_loaded(core: LoadedTarget) -> None:
    """Probes a freshly loaded target on one row of two samples: refuses a non-causal model, and moves a
    packed target whose samples leak into each other to padded rows (one log line)."""
    from dflash_pipe.compute.compile import apply_dynamo_settings

    apply_dynamo_settings()  # the probe may compile the target's layers: with the target threads' settings
    vocab, n = core.vocab_size, PROBE_LENGTH
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2 * n,), generator=gen)
    row = core.features(ids, [n, n])
    floor = _moved(core.features(ids, [n, n]), row, core)  # the same input again: the kernels' own noise

    # Causality: the last quarter of the row must not change the features of any position before it.
    cut = 2 * n - n // 2
    late = ids.clone()
    late[cut:] = (late[cut:] + 1) % vocab
    moved = _moved(core.features(late, [n, n])[:cut], row[:cut], core)
    if moved > _threshold(core, floor):
        raise UnsupportedTargetError(
            f"target {core.model_path}: its features at a position depend on later tokens (relative change "
            f"{moved:.1e} when only later tokens change), so it is not a causal LM; DFlash needs a causal "
            "decoder-only target"
        )
    if core.packing != "packed":
        return
    # Packing: sample 0's tokens must not change sample 1's features in the same row.
    other = ids.clone()
    other[:n] = (other[:n] + 1) % vocab
    leak = _moved(core.features(other, [n, n])[n:], row[n:], core)
    if leak > _threshold(core, floor):
        log.warning(
            "target %s (%s): samples packed into one row leak into each other (relative change %.1e of a "
            "sample when only the one before it changes); running right-padded rows instead (exact, slower)",
            core.model_path,
            core.plan.model_type,
            leak,
        )
        core.use_padded()


def _threshold(core: LoadedTarget, floor: float) -> float:
    """How far a feature may move without a leak. Measured: exactly 0 for every family of the coverage test
    (fp32 and bf16, CPU); a leak moves it by 6e-4 (a tiny random BERT's bidirectional attention) to tens of %
    (recurrent state across samples). bf16 leaves room for rounding; kernels that are not deterministic
    (atomics) raise the bar to well above their own run-to-run noise, so noise never reads as a leak."""
    base = 1e-5 if core.dtype == torch.float32 else 1e-2
    return max(base, 20 * floor)


def _moved(a: torch.Tensor, b: torch.Tensor, core: LoadedTarget) -> float:
    """The largest relative change of any selected layer's slice (a deep layer amplifies rounding, a leak
    shows from the first layer after it)."""
    hidden = core.hidden_size
    return max(
        _relative(a[:, j * hidden : (j + 1) * hidden], b[:, j * hidden : (j + 1) * hidden])
        for j in range(len(core.layer_ids))
    )


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))
