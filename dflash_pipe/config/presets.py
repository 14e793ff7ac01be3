"""Drafter presets: the shapes of the DFlash drafters people serve, by target.

A preset sets only what is the drafter's own choice: depth, layer types, sliding window and block size.
Every width (hidden size, heads, head_dim, KV heads, SwiGLU width, vocabulary, RoPE) follows the target
(`DrafterConfig.from_target`), so a preset applies to any target, the demo's included, and the drafter
always fits the target it is trained against. Each field can be overridden by its own flag or config key
(precedence: defaults < demo defaults < preset < config file < flags). docs/drafter.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .drafter import FULL_ATTENTION, SLIDING_ATTENTION


@dataclass(frozen=True, slots=True)
class DrafterPreset:
    name: str
    num_layers: int
    block_size: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    source: str  # where the shape comes from

    def options(self) -> dict[str, Any]:
        """The `drafter.*` config fields this preset sets."""
        return {
            "num_layers": self.num_layers,
            "block_size": self.block_size,
            "layer_types": self.layer_types,
            "sliding_window": self.sliding_window,
        }

    def summary(self) -> str:
        kinds = [(t, self.layer_types.count(t)) for t in (SLIDING_ATTENTION, FULL_ATTENTION)]
        layers = " + ".join(f"{n} {t.split('_')[0]}" for t, n in kinds if n)
        window = f", window {self.sliding_window}" if self.sliding_window else ""
        return f"{self.num_layers} layers ({layers}{window}), block size {self.block_size}"


def _preset(name: str, block_size: int, layer_types: tuple[str, ...], window: int | None, source: str):
    return DrafterPreset(
        name=name,
        num_layers=len(layer_types),
        block_size=block_size,
        layer_types=layer_types,
        sliding_window=window,
        source=source,
    )


_FULL, _SLIDING = (FULL_ATTENTION,), (SLIDING_ATTENTION,)
PRESETS: dict[str, DrafterPreset] = {
    p.name: p
    for p in (
        _preset(
            "qwen3-8b", 16, _FULL * 5, None, "the DFlash paper's Qwen3-8B recipe and its published drafter"
        ),
        _preset("qwen3.6-27b", 16, _SLIDING * 4 + _FULL, 2048, "the published Qwen3.6-27B drafter config"),
        _preset(
            "qwen3.5-35b-a3b", 16, _FULL * 8, None, "the published Qwen3.5-35B-A3B drafter config (8 layers)"
        ),
        _preset(
            "llama3.1-8b", 10, _FULL * 5, None, "the DFlash LLaMA-3.1-8B recipe (block size 10; depth: 5)"
        ),
    )
}


def preset_options(name: str) -> dict[str, Any]:
    """`drafter.*` fields of the preset `name`; a ValueError naming the known presets otherwise."""
    if name not in PRESETS:
        raise ValueError(f"drafter.preset {name!r}: unknown; choose one of {', '.join(PRESETS)}")
    return PRESETS[name].options()


def presets_help() -> str:
    """One line per preset, for --help."""
    return "; ".join(f"{p.name}: {p.summary()}" for p in PRESETS.values())
