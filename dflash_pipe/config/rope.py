"""The drafter's RoPE, computed by transformers' own RoPE initialisation (every variant it knows).

The drafter is served as a Qwen3-style model: vLLM, SGLang and the reference build its rotary embedding
from the exported ``rope_parameters`` the way transformers' ``Qwen3RotaryEmbedding`` does. So the
inverse frequencies and the attention factor come from ``transformers.modeling_rope_utils.
ROPE_INIT_FUNCTIONS`` (linear, dynamic, yarn, longrope, llama3, ... whatever the installed version has),
called on a Qwen3Config carrying the drafter's shapes, and the factor scales cos and sin as that class
does (yarn's mscale, longrope's attention factor).

Static frequencies: "dynamic" and "longrope" switch frequencies only past the original context length
(``original_max_position_embeddings`` / ``max_position_embeddings``); training positions stay below it
(``data.max_length``), where the static frequencies are the ones transformers uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import Tensor


class RopeShape(Protocol):
    """The drafter shapes its RoPE is built from (a ``DrafterConfig`` is one): typed here so the config,
    which checks its RoPE builds, can import this module without it importing the config back."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None


# Keys of a target's rope parameters that describe the target's own attention, not a RoPE variant: the
# drafter rotates its whole head_dim over 1-D text positions (docs/drafter.md, "RoPE").
TARGET_ONLY_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved", "rope_theta", "type")


def rope_type_of(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def known_rope_types() -> tuple[str, ...]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ("default", *sorted(k for k in ROPE_INIT_FUNCTIONS if k != "default"))


def rope_parameters(cfg: RopeShape) -> dict[str, Any]:
    """The transformers-5 ``rope_parameters`` dict of the drafter (what the export writes)."""
    return {
        **(cfg.rope_scaling or {}),
        "rope_type": rope_type_of(cfg.rope_scaling),
        "rope_theta": cfg.rope_theta,
    }


def _hf_config(cfg: RopeShape) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=rope_parameters(cfg),
    )


def rope_inv_freq(cfg: RopeShape) -> tuple[Tensor, float]:
    """([head_dim/2] float32 inverse frequencies, attention factor), as transformers computes them."""
    import torch

    rope_type = rope_type_of(cfg.rope_scaling)
    if rope_type == "default":  # transformers' default rule, written the same way (fp32)
        dim = cfg.head_dim
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
        return 1.0 / (cfg.rope_theta**exponent), 1.0
    # only here: importing transformers costs a worker ~2 s of start-up, and the default rule needs none of it
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"rope_scaling={cfg.rope_scaling}: rope_type {rope_type!r} is not one this transformers knows "
            f"({', '.join(known_rope_types())})"
        )
    try:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](_hf_config(cfg), None)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"rope_scaling={cfg.rope_scaling}: transformers could not build {rope_type!r} RoPE from it "
            f"({type(exc).__name__}: {exc}); give the keys that rope type needs (e.g. factor)"
        ) from None
    inv_freq = inv_freq.float().cpu()
    if inv_freq.shape != (cfg.head_dim // 2,):
        raise ValueError(
            f"rope_scaling={cfg.rope_scaling}: gives {inv_freq.numel()} frequencies, the drafter rotates "
            f"head_dim={cfg.head_dim} (needs {cfg.head_dim // 2}); drop partial-rotary keys"
        )
    return inv_freq, float(factor)
