"""How a packed batch (``input_ids [T]`` + per-sample ``lengths``) is laid out for the target's forward.

Two layouts, one interface (``model_inputs()`` for the HF forward, ``pack(x)`` to get ``[T, ...]`` back):

- ``PackedLayout`` (the default): all samples in ONE row ``[1, T]``, position ids restarting at 0 per sample,
  and attention that never crosses a sample boundary. No padding token is ever computed.
  - With ``attention="sdpa"`` the mask is left to transformers: when ``attention_mask`` is None and the
    position ids restart, ``masking_utils`` detects the packed format (``find_packed_sequence_indices``)
    and builds the block-diagonal causal mask itself (transformers 5.17 and 5.24 both do; it also gets
    sliding-window layers right). SDPA then computes every tile of the dense ``[T, T]`` mask.
  - With ``attention="flex"`` we build a ``BlockMask`` (causal AND same sample) and pass it as the 4-D
    attention mask, which every mask builder of transformers 5 returns unchanged; the attention layers call
    ``packed_flex_attention`` (registered under ``FLEX_ATTENTION``), i.e. compiled flex_attention, which
    skips every tile the mask empties: the attention cost is the sum of the samples' causal triangles.
- ``PaddedLayout``: right-padded ``[B, max_len]`` rows with a 2-D padding mask (the reference path; every
  pad position costs a full token of compute).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

Packing = Literal["packed", "padded"]
Attention = Literal["flex", "sdpa"]
FLEX_ATTENTION = "packed_flex"
# (no "flash" in the name: transformers treats any implementation name containing it as a flash-attn kernel)
"""The name ``packed_flex_attention`` is registered under in transformers' ``AttentionInterface``."""


def check_lengths(input_ids: torch.Tensor, lengths: Sequence[int]) -> list[int]:
    lens = [int(n) for n in lengths]
    if input_ids.dim() != 1:
        raise ValueError(
            f"input_ids must be packed 1-D [T], got shape {tuple(input_ids.shape)}; "
            "concatenate the samples and pass their lengths"
        )
    if not lens or min(lens) <= 0:
        raise ValueError(f"lengths must be a non-empty list of positive ints, got {lens}")
    if sum(lens) != input_ids.numel():
        raise ValueError(
            f"lengths sum to {sum(lens)} but input_ids has {input_ids.numel()} tokens; "
            "pass one length per packed sample"
        )
    return lens


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without making the host wait for the GPU's queued work (pinned + non_blocking)."""
    if device.type == "cuda" and host.device.type == "cpu":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass(frozen=True, slots=True)
class PaddedLayout:
    """Right-padded ``[B, S]`` view of a packed ``[T]`` batch, and the way back."""

    input_ids: torch.Tensor  # [B, S] int64, pad positions hold 0
    attention_mask: torch.Tensor  # [B, S] int64, 1 on real tokens
    valid: torch.Tensor  # [B, S] bool, same as attention_mask

    @classmethod
    def build(cls, input_ids: torch.Tensor, lengths: Sequence[int], device: torch.device) -> PaddedLayout:
        """Split ``input_ids [T]`` by ``lengths`` into right-padded rows on ``device``."""
        ids = _to_device(input_ids.long(), device)  # [T]
        lens = torch.as_tensor(list(lengths), dtype=torch.long, device=device)  # [B]
        batch, width = len(lengths), max(lengths)
        valid = torch.arange(width, device=device)[None, :] < lens[:, None]  # [B, S]
        padded = torch.zeros(batch, width, dtype=torch.long, device=device)  # [B, S]
        padded[valid] = ids  # row-major mask order == packed order
        return cls(input_ids=padded, attention_mask=valid.long(), valid=valid)

    def model_inputs(self) -> dict[str, Any]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S, ...]`` -> ``[T, ...]``: drop padding, samples back to back."""
        return x[self.valid]


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """All samples in one row ``[1, T]``; position ids restart per sample; no cross-sample attention."""

    input_ids: torch.Tensor  # [1, T'] int64 (T' >= T: compiled flex pads to whole tiles)
    position_ids: torch.Tensor  # [1, T'] int64, 0..len-1 within each sample (and within the padding)
    attention_mask: Any  # a flex BlockMask, or None (sdpa: transformers derives it from position_ids)
    total: int  # T, the real tokens
    lengths: tuple[int, ...]  # the row's segments: the samples, then flex's padding tail if any
    layer_types: tuple[str, ...] | None = None  # a hybrid's layer types: the BlockMask goes per type

    @classmethod
    def build(
        cls,
        input_ids: torch.Tensor,
        lengths: Sequence[int],
        device: torch.device,
        attention: Attention,
        *,
        compile: bool,
        layer_types: Sequence[str] | None = None,
    ) -> PackedLayout:
        """``layer_types`` (hybrids only): the mask then goes to the model as a ``{layer type: mask}`` mapping,
        attention types getting the BlockMask and linear-attention layers None (they take boundaries, not a
        mask), because transformers' padding-mask builder for linear layers cannot read a BlockMask."""
        total = sum(lengths)
        ids = input_ids.detach().cpu().long()
        pad = -total % FLEX_PAD_TO if attention == "flex" and compile else 0
        if pad:  # one extra "sample" of padding tokens that nothing else attends to
            lengths, ids = [*lengths, pad], torch.cat([ids, ids.new_zeros(pad)])
        lens = torch.as_tensor(list(lengths), dtype=torch.long)  # [B]
        starts = torch.cumsum(lens, 0) - lens  # [B]
        positions = torch.arange(total + pad) - torch.repeat_interleave(starts, lens)  # [T']
        sample = torch.repeat_interleave(torch.arange(len(lengths)), lens)  # [T']
        # One host tensor, one copy: ids, positions and sample index travel together.
        rows = _to_device(torch.stack([ids, positions, sample]), device)  # [3, T']
        mask = packed_block_mask(rows[2], compile=compile) if attention == "flex" else None
        return cls(
            input_ids=rows[0][None],
            position_ids=rows[1][None],
            attention_mask=mask,
            total=total,
            lengths=tuple(int(n) for n in lengths),
            layer_types=tuple(layer_types) if layer_types else None,
        )

    def model_inputs(self) -> dict[str, Any]:
        mask = self.attention_mask
        if mask is not None and self.layer_types is not None:
            mask = {t: None if t == LINEAR_ATTENTION else mask for t in set(self.layer_types)}
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": mask}

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, T', ...]`` -> ``[T, ...]`` (a view: the row already holds the samples back to back)."""
        return x[0, : self.total]


# --- flex_attention -------------------------------------------------------------------------------------

FLEX_PAD_TO = 128
"""Compiled flex rows are padded to whole 128-token tiles (at most 127 wasted tokens a batch): every
compiled kernel then sees full tiles only, and the row lengths fall into fewer dynamic-shape variants."""


@functools.cache
def _compiled(fn_name: str) -> Callable:
    """Compiled flex_attention / create_block_mask; dynamic=True so every new T reuses one graph."""
    from torch.nn.attention import flex_attention as flex

    return torch.compile(getattr(flex, fn_name), dynamic=True)


_COMPILE_LOCK = threading.Lock()
_compiled_for: set[tuple[str, str, str]] = set()


def _run_layer(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return type(layer).forward(layer, *args, **kwargs)  # the class's forward: hooks stay outside, eager


@functools.cache
def _compiled_layer() -> Callable:
    """One compiled function for every decoder layer of every replica: the weights are inputs, not
    constants, so all layers share one graph per length class; Inductor fuses the norms, RoPE and SwiGLU
    around the matmuls (flex_attention, called inside, becomes part of the graph)."""
    return torch.compile(_run_layer, dynamic=True)


def compiled_layer_forward(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``layer``'s forward through the shared compiled function (installed as its ``forward``)."""
    states = kwargs.get("hidden_states", args[0] if args else None)
    length = states.shape[-2] if isinstance(states, torch.Tensor) else 0
    return call_compiled(_compiled_layer(), length, states.device, layer, *args, **kwargs)


def call_compiled(
    fn_name: str | Callable, length: int, device: torch.device, /, *args: Any, **kwargs: Any
) -> Any:
    """Calls a compiled function (a flex function's name, or the compiled function itself); the first call
    per (function, device, length class) holds a process-wide lock, because compiling is not thread-safe and
    every target replica runs in its own thread. Length classes are where Dynamo specialises despite
    dynamic=True: T == 1, and one flex tile (T <= 128)."""
    size = "one" if length == 1 else "tile" if length <= 128 else "many"
    fn = _compiled(fn_name) if isinstance(fn_name, str) else fn_name
    key = (fn_name if isinstance(fn_name, str) else getattr(fn_name, "__name__", "layer"), str(device), size)
    if key in _compiled_for:
        return fn(*args, **kwargs)
    with _COMPILE_LOCK:
        out = fn(*args, **kwargs)
        _compiled_for.add(key)
    return out


def packed_block_mask(sample: torch.Tensor, *, compile: bool):
    """BlockMask for one packed row: query q sees key k iff k <= q and both belong to the same sample.

    ``sample [T]``: the sample index of each token. B = H = None (one mask for the batch row and every
    head). Compiled on CUDA so the ``[T, T]`` grid is never materialised. Indices are clamped because flex
    may evaluate the mask on padded positions past T inside a partial tile.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        last = sample.shape[0] - 1  # from the tensor, not a captured int: one compiled graph for every T
        q = torch.clamp(q_idx, max=last)
        kv = torch.clamp(kv_idx, max=last)
        return (kv_idx <= q_idx) & (sample[q] == sample[kv])

    n = sample.shape[0]
    if compile:
        return call_compiled(
            "create_block_mask", n, sample.device, mask_mod, None, None, n, n, device=sample.device
        )
    return create_block_mask(mask_mod, None, None, n, n, device=sample.device)


def packed_flex_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers ``AttentionInterface`` function: flex_attention with the batch's packed BlockMask.

    Returns ``[1, T, Hq, D]`` like every HF attention function. Only plain causal attention is supported;
    sliding-window, soft-capped or attention-sink layers are refused (``TargetCore`` picks sdpa or eager for
    such models).
    """
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if not isinstance(attention_mask, BlockMask):
        raise RuntimeError(
            f"{FLEX_ATTENTION} attention needs the packed BlockMask from dflash_pipe.target.packing, got "
            f"{type(attention_mask).__name__}; call the model through TargetCore, or load it with "
            'attn_implementation="sdpa" for a plain forward'
        )
    # s_aux: gpt-oss's attention sinks (an extra softmax column per head), which flex_attention lacks
    unsupported = {k: kwargs[k] for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None}
    if unsupported or dropout:
        raise RuntimeError(
            f"{type(module).__name__} asks for {unsupported or {'dropout': dropout}}, which the packed flex "
            'path does not implement; build the TargetCore with attention="sdpa"'
        )
    options = {"block_mask": attention_mask, "scale": scaling, "enable_gqa": query.shape[1] != key.shape[1]}
    if torch.compiler.is_compiling():  # inside a compiled decoder layer: part of that graph
        out = flex_attention(query, key, value, **options)
    elif query.device.type == "cuda":
        out = call_compiled("flex_attention", query.shape[2], query.device, query, key, value, **options)
    else:
        out = flex_attention(query, key, value, **options)  # [1, Hq, T, D]
    return out.transpose(1, 2).contiguous(), None


def register_flex_attention() -> str:
    """Registers ``packed_flex_attention`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(FLEX_ATTENTION, packed_flex_attention)
    return FLEX_ATTENTION


LINEAR_ATTENTION = "linear_attention"

FLEX_HYBRIDS = frozenset({"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"})
"""Hybrid text configs whose attention layers are plain causal attention (the linear-attention layers in
between take the sample boundaries instead of a mask, ``dflash_pipe.target.hybrid``)."""


def plain_causal(text_config: Any) -> bool:
    """True when every attention layer is full causal attention without soft-capping (what the flex path
    computes); the linear-attention layers of the hybrids in ``FLEX_HYBRIDS`` do not count."""
    if getattr(text_config, "attn_logit_softcapping", None) or getattr(text_config, "softcap", None):
        return False
    types = getattr(text_config, "layer_types", None)
    if types is not None:
        linear_ok = getattr(text_config, "model_type", None) in FLEX_HYBRIDS
        return all(t == "full_attention" or (linear_ok and t == LINEAR_ATTENTION) for t in types)
    return getattr(text_config, "sliding_window", None) is None and not getattr(
        text_config, "attention_chunk_size", None
    )
