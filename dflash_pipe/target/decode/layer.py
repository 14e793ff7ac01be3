"""One decoder layer of the slot stack, as module-level functions of a layer's HF modules and a frozen
``LayerMath``: one compiled graph (per function, dynamic sizes) then serves every layer of every stack of
the process, the weights being inputs rather than constants. The stack calls them between its cache writes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_pipe.target.decode.attention_kernel import combine
from dflash_pipe.target.decode.fuse import FusedLayer


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True)
class LayerMath:
    """What a layer's arithmetic needs besides its modules: fixed per model, constants to the compiler."""

    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    qk_norm: bool
    decode_attention: str
    gqa: bool
    """heads != kv_heads, as a field: Dynamo may trace the ints above as sizes, and SDPA's ``enable_gqa``
    takes a plain bool only."""

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


# --- one decoder layer: module-level functions, so one compiled graph serves every layer ----------------


def _project(m: LayerMath, layer: nn.Module, fused: FusedLayer, x: torch.Tensor, cos, sin):
    """q ``[B, T, heads, D]``, k and v ``[B, T, kv_heads, D]``, rotated by ``cos``/``sin`` ``[B, T, 1, D]``."""
    attn = layer.self_attn
    b, t = x.shape[:2]
    d = m.head_dim
    if fused.qkv_weight is not None:
        qkv = F.linear(x, fused.qkv_weight, fused.qkv_bias)
        q, k, v = qkv.split([m.heads * d, m.kv_heads * d, m.kv_heads * d], dim=-1)
        q, k, v = q.reshape(b, t, -1, d), k.reshape(b, t, -1, d), v.reshape(b, t, -1, d)
    else:
        q = attn.q_proj(x).view(b, t, -1, d)
        k = attn.k_proj(x).view(b, t, -1, d)
        v = attn.v_proj(x).view(b, t, -1, d)
    if m.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    return q, k, v


def _finish(layer: nn.Module, fused: FusedLayer, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """The attention output projected and added, then the MLP block (HF's gated MLP on the fused weight)."""
    h = h + layer.self_attn.o_proj(attended)
    x = layer.post_attention_layernorm(h)
    mlp = layer.mlp
    if fused.gate_up_weight is not None:
        gate, up = F.linear(x, fused.gate_up_weight).chunk(2, dim=-1)
        return h + mlp.down_proj(mlp.act_fn(gate) * up)
    out = mlp(x)
    if isinstance(out, tuple):  # MoE blocks of some releases return (hidden, router logits)
        out = out[0]
    return h + out


def layer_in(m: LayerMath, layer: nn.Module, fused: FusedLayer, h: torch.Tensor, cos, sin):
    """A layer's input norm, q/k/v projections, q/k norms and RoPE (decode and prefill alike)."""
    return _project(m, layer, fused, layer.input_layernorm(h), cos, sin)


def decode_out(
    m: LayerMath,
    layer: nn.Module,
    fused: FusedLayer,
    h: torch.Tensor,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    span: int,
) -> torch.Tensor:
    """One query per slot ``[S, 1, heads, D]`` against the first ``span`` columns of the layer's cache
    ``[S, kvh, L+1, D]``, then the rest of the layer."""
    s = h.shape[0]
    keys, values = keys[:, :, :span], values[:, :, :span]  # [S, kvh, span, D]
    if m.decode_attention == "sdpa":
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, scale=m.scaling, enable_gqa=True
        )  # [S, heads, 1, D]
    else:  # two batched matmuls that repeat no keys
        grouped = q.view(s, m.kv_heads, m.groups, m.head_dim)  # [S, kvh, G, D]
        scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * m.scaling + mask
        attended = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)  # [S, kvh, G, D]
    return _finish(layer, fused, h, attended.reshape(s, 1, -1))


def combine_out(
    m: LayerMath,
    layer: nn.Module,
    fused: FusedLayer,
    h: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
) -> torch.Tensor:
    """The Triton kernel's output (its split outputs merged by ``attention_kernel.combine``, or the
    attention itself when it ran one split), then the rest of the layer."""
    return _finish(layer, fused, h, combine(out, lse, m.groups, h.dtype)[:, None])


def _prefill_attend(m: LayerMath, q, keys, values, mask: torch.Tensor | None) -> torch.Tensor:
    """Queries ``[k, n, heads, D]`` against ``[k, kvh, *, D]``: ``[k, n, heads * D]``."""
    k_rows, n = q.shape[:2]
    attended = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys,
        values,
        attn_mask=mask,
        is_causal=mask is None,
        scale=m.scaling,
        enable_gqa=m.gqa,  # no repeated keys: copying them cost a third of a prefill's time
    )  # [k, heads, n, D]
    return attended.transpose(1, 2).reshape(k_rows, n, -1)


def prefill_out(m: LayerMath, layer: nn.Module, fused: FusedLayer, h, q, k, v) -> torch.Tensor:
    """Fresh slots (nothing cached before): right-padded rows attend causally to their own new tokens
    ``k``/``v`` ``[k, n, kvh, D]``; then the rest of the layer."""
    return _finish(layer, fused, h, _prefill_attend(m, q, k.transpose(1, 2), v.transpose(1, 2), None))


def packed_out(m: LayerMath, layer: nn.Module, fused: FusedLayer, h, q, k, v, block_mask) -> torch.Tensor:
    """Fresh slots' prompts back to back in one row ``[1, T, ...]``: flex attention through ``block_mask``
    (causal within each prompt, nothing across: ``target.packing.packed_block_mask``), so no padding
    token is computed; then the rest of the layer."""
    from torch.nn.attention.flex_attention import flex_attention

    t = q.shape[1]
    attended = flex_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        block_mask=block_mask,
        scale=m.scaling,
        enable_gqa=m.gqa,
    )  # [1, heads, T, D]
    return _finish(layer, fused, h, attended.transpose(1, 2).reshape(1, t, -1))


def extend_out(
    m: LayerMath, layer: nn.Module, fused: FusedLayer, h, q, keys, values, mask: torch.Tensor
) -> torch.Tensor:
    """Rows after what their slots hold: they attend to their slots' first ``span`` columns ``[k, kvh,
    span, D]`` through ``mask`` ``[k, 1, n, span]``; then the rest of the layer."""
    return _finish(layer, fused, h, _prefill_attend(m, q, keys, values, mask))


@functools.cache
def compile_layer_fn(fn: Callable, m: LayerMath, dynamic: bool = True) -> Callable:
    """``fn`` with ``m`` bound, compiled once per process: with ``dynamic`` sizes every layer, slot count,
    span and prefill shape reuses its graphs (the weights are inputs, not constants); without, the graph
    is specialised to the sizes of its first call (a decode step's: they are fixed per slot count, and
    kernels that know them are 7% faster at the Qwen3-1.7B shape, batch 64: ``docs/performance.md``). Each bound function gets
    a code object of its own: Dynamo caches per code object, and on a shared one every function would be a
    recompile of the others (the recompile limit would soon send them to eager)."""

    def bound(*args: Any) -> Any:
        return fn(m, *args)

    bound.__code__ = bound.__code__.replace(co_name=fn.__name__, co_qualname=fn.__name__)
    bound.__name__ = fn.__name__
    return torch.compile(bound, dynamic=dynamic)
