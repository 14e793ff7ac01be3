"""Packed rows for hybrid targets: linear-attention layers see the sample boundaries, nothing else changes.

A hybrid target (Qwen3.5/3.6, Qwen3.5-MoE, Qwen3-Next, Kimi-Linear) mixes full-attention layers with
linear-attention layers that carry a recurrent state and a causal conv1d window along the sequence. In a
packed row ``[1, T]`` both would run straight across the boundary between two samples, so every sample after
the first would get wrong features. The full-attention layers stay packed (block-diagonal mask); each
linear-attention *mixer* module (``Qwen3_5GatedDeltaNet`` and the like) has its ``forward`` replaced by one
that keeps the samples apart:

- ``fast``: a packed forward that hands the boundaries to flash-linear-attention's kernels (``cu_seqlens``;
  ``dflash_pipe.target.gated_deltanet``), on CUDA where ``fla`` imports and the mixer's layout is known;
- ``per-sample``: otherwise the mixer's own HF forward on right-padded rows (one row per sample, padding
  masked), packed back. Right padding never reaches a real token through a causal conv or a recurrence, so
  this is exact on any transformers version; only the linear layers pay for the padding.

What the packed path has not been proven on is never packed: ``inspect_layers`` names any layer type or
sequence-mixing module it does not know (a ``layer_types`` value other than attention, a conv1d or a
recurrent block outside a known mixer), and ``TargetCore`` then runs the whole target padded, saying so once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

log = logging.getLogger("dflash_pipe.target")

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
"""``layer_types`` values whose layers the packed row serves with a block-diagonal attention mask."""

LINEAR_LAYER_TYPE = "linear_attention"

LINEAR_MIXERS: dict[str, str | None] = {
    "Qwen3_5GatedDeltaNet": "qwen3_5",
    "Qwen3_5MoeGatedDeltaNet": "qwen3_5",
    "Qwen3NextGatedDeltaNet": "qwen3_next",
    "KimiLinearDeltaAttention": None,
}
"""Linear-attention mixer classes proven exact (tests/target/test_hybrid.py) -> their fast packed layout
(``dflash_pipe.target.gated_deltanet``), or None where only the per-sample path exists."""

_RECURRENT_NAME = re.compile(
    r"Mamba|DeltaNet|Recurrent|Rwkv|RWKV|ShortConv|Ssm|SSM|Retention|Hyena|Lightning"
)
"""Class names of sequence mixers that carry state along the row (matched outside the known mixers).
Case-sensitive CamelCase parts: "ssm" in any case would also match GptOssMLP."""

PACKED_ONLY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


@dataclass(frozen=True, slots=True)
class HybridPlan:
    """What ``inspect_layers`` found: the linear-attention mixers to wrap, or why the row must be padded."""

    mixers: tuple[tuple[int, nn.Module], ...]  # (decoder layer index, mixer module)
    unproven: str | None  # None, or which layers/modules the packed path does not know, and why

    @property
    def hybrid(self) -> bool:
        return bool(self.mixers)


def inspect_layers(text_config: Any, layers: nn.ModuleList) -> HybridPlan:
    """Classify every decoder layer: attention (packed as is), a known linear-attention mixer (wrapped), or
    unknown (the target runs padded).

    The rule: a ``layer_types`` value must be an attention type or ``linear_attention``; a
    ``linear_attention`` layer must hold a known mixer (``LINEAR_MIXERS``); and outside known mixers no layer
    may hold a ``Conv1d`` or a module whose class name says it is recurrent (Mamba, RWKV, short convs, ...),
    with or without ``layer_types``.
    """
    types = list(getattr(text_config, "layer_types", None) or [])
    problems: list[str] = []
    odd = sorted({t for t in types if t not in ATTENTION_LAYER_TYPES and t != LINEAR_LAYER_TYPE})
    if odd:
        where = [i for i, t in enumerate(types) if t in odd]
        problems.append(
            f"layer type(s) {odd} (layers {_span(where)}) are neither attention nor linear attention"
        )
    mixers: list[tuple[int, nn.Module]] = []
    for index, layer in enumerate(layers):
        known = [m for m in layer.modules() if type(m).__name__ in LINEAR_MIXERS]
        inside = {id(sub) for m in known for sub in m.modules()}
        stray = sorted(
            {
                type(m).__name__
                for m in layer.modules()
                if id(m) not in inside
                and m is not layer
                and (isinstance(m, nn.Conv1d) or _RECURRENT_NAME.search(type(m).__name__))
            }
        )
        if stray:
            problems.append(
                f"layer {index} holds {', '.join(stray)}, a sequence mixer the packed row is not proven on"
            )
        if index < len(types) and types[index] == LINEAR_LAYER_TYPE and not known:
            names = sorted({type(m).__name__ for m in layer.children()})
            problems.append(f"linear-attention layer {index} holds none of the known mixers (it has {names})")
        mixers.extend((index, m) for m in known)
    return HybridPlan(mixers=tuple(mixers), unproven="; ".join(problems) or None)


def _span(indices: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in indices[:6])
    return shown + (f", ... ({len(indices)} layers)" if len(indices) > 6 else "")


@dataclass(frozen=True, slots=True)
class Segments:
    """The samples of one packed row, in the forms the linear-attention paths take."""

    lengths: tuple[int, ...]  # every segment of the row, flex's padding tail included
    cu_seqlens: torch.Tensor  # [N+1] int64 on the row's device (flash-linear-attention's varlen API)
    cu_seqlens_cpu: torch.Tensor  # [N+1] int64 on the host (saves the kernels a device->host copy)
    slots: torch.Tensor  # [T] int64: where token t sits in the right-padded [N * S] rows

    @classmethod
    def build(cls, lengths: Sequence[int], device: torch.device) -> Segments:
        lens = torch.as_tensor(list(lengths), dtype=torch.long)  # [N]
        cu = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0))  # [N+1]
        width = int(lens.max())
        starts = torch.repeat_interleave(cu[:-1], lens)  # [T]
        rows = torch.repeat_interleave(torch.arange(len(lens)), lens)  # [T]
        slots = rows * width + torch.arange(int(cu[-1])) - starts  # [T]
        return cls(
            lengths=tuple(int(n) for n in lengths),
            cu_seqlens=cu.to(device),
            cu_seqlens_cpu=cu,
            slots=slots.to(device),
        )

    @property
    def width(self) -> int:
        return max(self.lengths)

    def unpack(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1, T, ...]`` -> right-padded ``[N, S, ...]`` (zeros in the padding) and its ``[N, S]`` mask."""
        n, width = len(self.lengths), self.width
        rows = x.new_zeros(n * width, *x.shape[2:])
        rows.index_copy_(0, self.slots, x[0])
        mask = torch.zeros(n * width, dtype=torch.long, device=x.device)
        mask[self.slots] = 1
        return rows.view(n, width, *x.shape[2:]), mask.view(n, width)

    def pack(self, rows: torch.Tensor) -> torch.Tensor:
        """``[N, S, ...]`` -> ``[1, T, ...]`` (the inverse of ``unpack`` on real tokens)."""
        return rows.reshape(-1, *rows.shape[2:]).index_select(0, self.slots)[None]

    def to(self, device: torch.device) -> Segments:
        """The same segments with their device tensors on ``device`` (a target split across GPUs)."""
        if self.slots.device == device:
            return self
        return Segments(
            lengths=self.lengths,
            cu_seqlens=self.cu_seqlens.to(device),
            cu_seqlens_cpu=self.cu_seqlens_cpu,
            slots=self.slots.to(device),
        )


class Boundaries:
    """The current packed row's segments, read by the wrapped mixers during one forward (None outside)."""

    def __init__(self) -> None:
        self.current: Segments | None = None
        self._copies: dict[torch.device, Segments] = {}

    @contextlib.contextmanager
    def active(self, segments: Segments | None) -> Iterator[None]:
        self.current, self._copies = segments, {}
        try:
            yield
        finally:
            self.current, self._copies = None, {}

    def on(self, device: torch.device) -> Segments | None:
        """The current segments on ``device`` (copied once per forward for each further device)."""
        if self.current is None:
            return None
        if device not in self._copies:
            self._copies[device] = self.current.to(device)
        return self._copies[device]


FastForward = Callable[[nn.Module, torch.Tensor, Segments], torch.Tensor]


def wrap_mixers(
    plan: HybridPlan, boundaries: Boundaries, fast: Callable[[nn.Module], FastForward | None]
) -> dict[str, int]:
    """Replaces each mixer's ``forward`` (instance attribute; the class stays untouched). ``fast(module)``
    gives the packed kernel forward for that module, or None for the per-sample path. Returns how many
    mixers took each path."""
    counts = {"fast": 0, "per-sample": 0}
    for _index, module in plan.mixers:
        forward = fast(module)
        counts["fast" if forward is not None else "per-sample"] += 1
        # Eager inside a compiled decoder layer: the kernels autotune and prepare indices on the host, and the
        # per-sample path's row width changes every batch (Dynamo would recompile per batch).
        module.forward = torch.compiler.disable(
            functools.partial(_packed_mixer_forward, module, boundaries, forward)
        )
    return counts


def _packed_mixer_forward(
    module: nn.Module, boundaries: Boundaries, fast: FastForward | None, *args: Any, **kwargs: Any
) -> Any:
    """The mixer on a packed row with its samples kept apart; the class's own forward when no packed row is
    active (a padded batch, or a plain forward outside ``TargetCore``)."""
    original = type(module).forward
    if boundaries.current is None:
        return original(module, *args, **kwargs)
    args_list = list(args)
    hidden = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args_list.pop(0)  # [1, T, H]
    segments = boundaries.on(hidden.device)
    assert segments is not None
    if hidden.shape[0] != 1 or hidden.shape[1] != sum(segments.lengths):
        raise RuntimeError(
            f"{type(module).__name__} got hidden states of shape {tuple(hidden.shape)} inside a packed row of "
            f"{sum(segments.lengths)} tokens; dflash_pipe.target.hybrid does not know this layer's calling "
            "convention"
        )
    if fast is not None:
        return fast(module, hidden, segments)
    for name in PACKED_ONLY_KWARGS:
        kwargs.pop(name, None)
    rows, mask = segments.unpack(hidden)  # [N, S, H], [N, S]
    kwargs["attention_mask"] = mask
    out = original(module, rows, *args_list, **kwargs)
    if isinstance(out, tuple):
        return (segments.pack(out[0]), *out[1:])
    return segments.pack(out)


def describe(counts: dict[str, int]) -> str:
    parts = []
    if counts.get("fast"):
        parts.append(f"{counts['fast']} through flash-linear-attention with sample boundaries")
    if counts.get("per-sample"):
        parts.append(f"{counts['per-sample']} per sample on right-padded rows (HF's own forward)")
    return "linear-attention layers: " + ", ".join(parts)
