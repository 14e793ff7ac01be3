"""DrafterConfig: every shape the reference config.json needs, derived from the target's HF config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from .mask_token import (
    MASK_TOKEN_KEY,
    MaskTokenError,
    given_mask_token,
    mask_token_conflict,
    resolve_mask_token,
)

# gamma of the per-slot loss decay exp(-(k-1)/gamma) for the block sizes the DFlash recipes use.
_KNOWN_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
# Attention pattern of a draft layer, the names the serving engines read from config.json `layer_types`.
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
# SwiGLU width of a drafter for a target whose config has no dense `intermediate_size` (qwen3_5_moe): the
# ratio qwen3_moe's configs carry (intermediate_size 6144 for hidden 2048), so MoE drafters match.
MOE_FFN_RATIO = 3
# KV heads of a drafter for an MLA target (DeepSeek-V3, Kimi): MLA has no GQA count to copy.
MLA_KV_HEADS = 8


def gamma_for_block_size(block_size: int) -> float:
    """Loss-decay constant: the published values for 16/10/8; otherwise scaled linearly from bs 16.

    The rule for other sizes, gamma = max(1, 7 * (bs - 1) / 15), keeps the bs-16 recipe's ratio of gamma to
    the number of scored slots (bs - 1), so the weight of the last slot stays about exp(-2).
    """
    if block_size in _KNOWN_GAMMA:
        return _KNOWN_GAMMA[block_size]
    return max(1.0, 7.0 * (block_size - 1) / 15.0)


class EngineConflictError(ValueError):
    """A drafter setting the serving engines cannot serve (a feature layer they cannot capture, a mask token
    id their tokenizer contradicts), refused before training; one line naming the flag and the fix."""


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Evenly spread layer ids from 1 to L-3: round(1 + i*(L-4)/(n-1)); a single layer takes L // 2 (L - 2
    on a 2-layer target). Never the last layer, L - 1, which the engines cannot capture (check_capturable)."""
    if num_draft_layers == 1:
        return (min(num_target_layers // 2, max(num_target_layers - 2, 0)),)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


def read_rope(target_config: Any) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either transformers-4 or transformers-5 style configs.

    transformers 5 keeps both in `config.rope_parameters` (possibly one dict per layer type); older
    versions have `rope_theta` and `rope_scaling` attributes.
    """
    params = getattr(target_config, "rope_parameters", None)
    if isinstance(params, dict) and params and "rope_theta" not in params and "rope_type" not in params:
        # per-layer-type dicts (e.g. {"full_attention": {...}, "sliding_attention": {...}})
        nested = params.get("full_attention") or next(iter(params.values()))
        params = nested if isinstance(nested, dict) else None
    theta = getattr(target_config, "rope_theta", None)
    scaling = getattr(target_config, "rope_scaling", None)
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        scaling = dict(params)
    if theta is None:
        theta = 10000.0
    from .rope import TARGET_ONLY_ROPE_KEYS

    if isinstance(scaling, dict):
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = {k: v for k, v in scaling.items() if k not in TARGET_ONLY_ROPE_KEYS}
        scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
    else:
        scaling = None
    return float(theta), scaling


def check_layer_types(
    layer_types: Any, num_layers: int, sliding_window: Any, *, names: tuple[str, str]
) -> tuple[str, ...]:
    """layer_types as a tuple (None: all full_attention), checked against the depth and the window.

    ``names``: how the caller's input spells the two fields (e.g. "drafter.layer_types (--layer-types)").
    """
    types = tuple(layer_types) if layer_types is not None else (FULL_ATTENTION,) * num_layers
    if any(t not in LAYER_TYPES for t in types) or len(types) != num_layers:
        raise ValueError(
            f"{names[0]}={list(types)}: give one of {', '.join(LAYER_TYPES)} per draft layer ({num_layers} layers)"
        )
    if SLIDING_ATTENTION in types:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(
                f"{names[1]}={sliding_window!r}: sliding_attention layers need a window of >= 1 keys "
                "(the query included), e.g. 2048"
            )
    elif sliding_window is not None:
        raise ValueError(
            f"{names[1]}={sliding_window}: no layer is sliding_attention; set {names[0]} or leave the window out"
        )
    return types


def uncapturable_layers_error(layer_ids: Any, num_target_layers: int) -> str | None:
    """Why ``layer_ids`` cannot be served, or None. vLLM and SGLang take target layer i's output as the input
    of layer i + 1 (vLLM: ``eagle_aux_hidden_state_layer_ids`` = id + 1; SGLang: ``set_dflash_layers_to_capture``
    captures layer id + 1's input), so the last layer, L - 1, has nothing to capture it."""
    last = num_target_layers - 1
    if last not in tuple(layer_ids):
        return None
    ids = ",".join(str(i) for i in layer_ids)
    return (
        f"--target-layer-ids {ids}: {last} is the target's last layer (it has {num_target_layers} layers, ids "
        f"0-{last}), and vLLM and SGLang capture a feature layer as the input of layer id+1, which the last "
        f"layer does not have: a drafter trained on it cannot be served. Pick ids in 0-{last - 1}, or leave "
        "the flag out for the even-spread default"
    )


def check_capturable(layer_ids: Any, num_target_layers: int) -> None:
    """``EngineConflictError`` when a feature layer is one the serving engines cannot capture (the last)."""
    problem = uncapturable_layers_error(layer_ids, num_target_layers)
    if problem is not None:
        raise EngineConflictError(problem)


@dataclass(kw_only=True, slots=True)
class DrafterConfig:
    """Shapes of the DFlash drafter (the target's width) plus the training switches."""

    hidden_size: int  # target width H
    intermediate_size: int  # SwiGLU inner width (target's)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int = 5  # draft layers
    vocab_size: int  # target vocabulary (embedding / LM head rows)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None  # None = plain RoPE; {"rope_type": "yarn"|"llama3"|..., ...} (rope.py)
    max_position_embeddings: int = 40960
    layer_types: tuple[str, ...] | None = None  # one of LAYER_TYPES per draft layer; None = all full
    sliding_window: int | None = None  # keys a sliding_attention query sees, itself included
    block_size: int = 16  # tokens per draft block: [anchor token, MASK x (bs-1)]
    mask_token_id: int  # id fed to the MASK slots (target embedding row)
    target_layer_ids: tuple[int, ...]  # target layers whose outputs are the context features
    num_target_layers: int  # L of the target
    max_anchors: int = 512  # anchors (blocks) sampled per sequence in training
    attention_backend: Literal["auto", "flex", "sdpa"] = (
        "auto"  # auto = flex on CUDA (head_dim >= 16), else sdpa
    )
    extra: dict = field(default_factory=dict)  # free-form provenance (e.g. target model name)

    def __post_init__(self) -> None:
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_hidden_layers",
            "vocab_size",
            "max_position_embeddings",
            "num_target_layers",
            "max_anchors",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive int")
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size}: must be >= 2 (slot 0 is the anchor token)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads}: must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id}: must be in [0, vocab_size={self.vocab_size}); "
                "pass --mask-token-id with a row of the target's embedding"
            )
        ids = self.target_layer_ids
        if not ids:
            raise ValueError("target_layer_ids=(): give at least one target layer id")
        if list(ids) != sorted(set(ids)):
            raise ValueError(
                f"target_layer_ids={ids}: must be sorted and unique, e.g. {tuple(sorted(set(ids)))}"
            )
        if ids[0] < 0 or ids[-1] >= self.num_target_layers:
            raise ValueError(
                f"target_layer_ids={ids}: every id must be in [0, num_target_layers={self.num_target_layers})"
            )
        if self.attention_backend not in ("auto", "flex", "sdpa"):
            raise ValueError(f"attention_backend={self.attention_backend!r}: use 'auto', 'flex' or 'sdpa'")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps}: must be > 0")
        self._check_layer_types()
        from .rope import rope_inv_freq, rope_type_of  # torch: not at import (the CLI reads this module)

        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)
            if rope_type_of(self.rope_scaling) == "default":
                self.rope_scaling = None
        rope_inv_freq(self)  # raises a ValueError naming rope_scaling if transformers cannot build it

    def _check_layer_types(self) -> None:
        self.layer_types = check_layer_types(
            self.layer_types,
            self.num_hidden_layers,
            self.sliding_window,
            names=("layer_types", "sliding_window"),
        )

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per draft layer: None for full_attention, the window for sliding_attention (masks.py)."""
        return tuple(self.sliding_window if t == SLIDING_ATTENTION else None for t in self.layer_types)

    @property
    def gamma(self) -> float:
        """Decay constant of the slot weights exp(-(k-1)/gamma)."""
        return gamma_for_block_size(self.block_size)

    @property
    def feature_size(self) -> int:
        """Width of the concatenated context features: k * H."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        *,
        tokenizer: Any = None,
        num_layers: int = 5,
        block_size: int = 16,
        mask_token_id: int | None = None,
        target_layer_ids: tuple[int, ...] | list[int] | None = None,
        **overrides: Any,
    ) -> DrafterConfig:
        """Drafter shapes from any HF causal-LM config (Qwen3Config, LlamaConfig, multimodal wrappers, ...).

        The drafter has the target's width (hidden size, heads, head_dim, KV heads, SwiGLU width, vocab,
        RoPE). Where a family has no such field (docs/drafter.md, "Shapes from the target"): an MoE config
        without a dense ``intermediate_size`` gives MOE_FFN_RATIO x hidden; an MLA config (DeepSeek-V3,
        Kimi: ``kv_lora_rank``) gives head_dim = ``v_head_dim``, the target's head count, MLA_KV_HEADS KV
        heads (or the largest divisor of the head count below it). gpt-oss's attention sinks and any
        target's sliding windows are the target's attention, not the drafter's (its layer types are its own).
        What the serving engines would refuse is refused here (``EngineConflictError``): the target's last
        layer as a feature layer, and a mask token id that the tokenizer's "<|MASK|>" contradicts.
        """
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        heads = int(tc.num_attention_heads)
        hidden = int(tc.hidden_size)
        head_dim = getattr(tc, "head_dim", None) or hidden // heads
        kv_heads = int(getattr(tc, "num_key_value_heads", None) or heads)
        if getattr(tc, "kv_lora_rank", None):  # MLA
            head_dim = int(tc.v_head_dim)
            kv_heads = max(d for d in range(1, min(MLA_KV_HEADS, heads) + 1) if heads % d == 0)
        ffn = getattr(tc, "intermediate_size", None) or MOE_FFN_RATIO * hidden
        num_target_layers = int(tc.num_hidden_layers)
        vocab_size = int(tc.vocab_size)
        if mask_token_id is None:
            if tokenizer is None:
                raise MaskTokenError(
                    "mask_token_id=None and no tokenizer to look one up in: pass --mask-token-id "
                    "(a reserved/unused row of the target's embedding)"
                )
            choice = resolve_mask_token(tokenizer, vocab_size)
        else:
            choice = given_mask_token(tokenizer, int(mask_token_id))
        mask_token_id = choice.id
        if tokenizer is not None:
            problem = mask_token_conflict(tokenizer, int(mask_token_id), vocab_size)
            if problem is not None:
                raise EngineConflictError(problem)
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers, num_layers)
        check_capturable(target_layer_ids, num_target_layers)
        theta, scaling = read_rope(tc)
        kwargs: dict[str, Any] = dict(
            hidden_size=hidden,
            intermediate_size=int(ffn),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            num_hidden_layers=num_layers,
            vocab_size=vocab_size,
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(getattr(tc, "max_position_embeddings", 40960)),
            block_size=block_size,
            mask_token_id=int(mask_token_id),
            target_layer_ids=tuple(target_layer_ids),
            num_target_layers=num_target_layers,
        )
        kwargs.update(overrides)
        kwargs["extra"] = {**kwargs.get("extra", {}), MASK_TOKEN_KEY: choice.to_dict()}
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (tuples become lists)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["target_layer_ids"] = list(self.target_layer_ids)
        out["layer_types"] = list(self.layer_types)
        out["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling is not None else None
        out["extra"] = dict(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        """Inverse of to_dict; unknown keys are an error (they mean a version mismatch)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"DrafterConfig.from_dict: unknown keys {unknown}; known: {sorted(names)}")
        return cls(**data)
