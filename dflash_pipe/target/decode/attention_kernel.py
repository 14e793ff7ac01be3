"""Decode attention that reads only each slot's live columns: a Triton kernel (CUDA only).

A decode step at batch 64 and a 768-column span reads 5.6 GB of keys and values at the Qwen3-1.7B shape,
more than the weights; SDPA and batched matmuls over a static span read every column up to the span for
every slot, whether the slot holds 100 tokens or 700. This kernel reads columns ``< length`` of each slot
only, once per KV head for all the query heads of its group (no repeated keys), split along the columns
when too few (slot, head) programs would fill the GPU. The splits' partial outputs are combined by
``combine`` (plain torch, fused into the compiled rest of the layer).

Shapes are fixed per (slot count, span), so a step that calls it is captured in a CUDA graph like the
others; the kernel is compiled by Triton on its first call (the engine's warm-up steps, before capture).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

BLOCK_N = 64
"""Key columns per inner iteration."""
MIN_PROGRAMS = 264
"""Programs (slot x KV head x split) wanted at least: two per SM of an H100/H200."""


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Launch settings (``bench/decode_kernels.py`` sweeps them); ``splits`` None: ``splits_for``."""

    block: int = BLOCK_N
    warps: int = 4
    stages: int = 2
    splits: int | None = None


DEFAULT = KernelConfig()


def config_for(rows: int) -> KernelConfig:
    """The sweep's best on the H200 (``bench/results/h200_decode_static_step/``): three pipeline stages up to 64
    rows (7% faster than two at the Qwen3-1.7B and 8B shapes, batch 64, span 768), two above (5% faster
    at 256 rows)."""
    return KernelConfig(stages=3) if rows <= 64 else DEFAULT


def supported(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """bf16/fp16 on CUDA with a power-of-two head dim of 16 or more (fp32 stays on SDPA: Triton's dot would
    round it to tf32, and fp32 is where decoding is checked token for token against HF)."""
    return (
        device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
    )


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def decode_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        lengths_ptr,
        slots_ptr,
        new_k_ptr,
        new_v_ptr,
        write_ptr,
        out_ptr,
        lse_ptr,
        stride_qs,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_kn,
        stride_vs,
        stride_vh,
        stride_vn,
        stride_nks,
        stride_nkh,
        stride_nvs,
        stride_nvh,
        scale,
        chunk,
        SPLITS: tl.constexpr,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        WRITE: tl.constexpr,
        DIRECT: tl.constexpr,
    ):
        s = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        heads_kv = tl.num_programs(1)
        n = tl.load(lengths_ptr + s)
        slot = tl.load(slots_ptr + s).to(tl.int64)  # the cache row this query reads
        start = sp * chunk
        end = tl.minimum(start + chunk, n)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        q = tl.load(
            q_ptr + s * stride_qs + (kh * G + g)[:, None] * stride_qh + d[None, :],
            mask=(g < G)[:, None],
            other=0.0,
        )
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        k_base = k_ptr + slot * stride_ks + kh * stride_kh
        v_base = v_ptr + slot * stride_vs + kh * stride_vh
        if WRITE:  # this row's new key and value: used from registers, stored by split 0
            written = tl.load(write_ptr + s)  # the column this row's key goes to
            new_k = tl.load(new_k_ptr + s * stride_nks + kh * stride_nkh + d)
            new_v = tl.load(new_v_ptr + s * stride_nvs + kh * stride_nvh + d)
            if sp == 0:
                tl.store(k_base + written * stride_kn + d, new_k)
                tl.store(v_base + written * stride_vn + d, new_v)
        for block in range(0, tl.cdiv(tl.maximum(end - start, 0), BLOCK)):  # this split's live columns
            cols = start + block * BLOCK + tl.arange(0, BLOCK)
            valid = cols < end
            k = tl.load(k_base + cols[:, None] * stride_kn + d[None, :], mask=valid[:, None], other=0.0)
            if WRITE:  # that column may be read before split 0 stored it: from registers
                k = tl.where((cols == written)[:, None], new_k[None, :], k)
            scores = tl.dot(q, tl.trans(k)) * scale  # [G_PAD, BLOCK], fp32
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))  # finite: every block holds a live column
            alpha = tl.exp(m_i - m_new)
            p = tl.where(valid[None, :], tl.exp(scores - m_new[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + cols[:, None] * stride_vn + d[None, :], mask=valid[:, None], other=0.0)
            if WRITE:
                v = tl.where((cols == written)[:, None], new_v[None, :], v)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        if DIRECT:  # one split: the attention itself, [S, heads * D] in the model's dtype
            head = kh * G + g
            where = out_ptr + (s * heads_kv * G + head)[:, None] * D + d[None, :]
            tl.store(where, out.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])
        else:
            lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
            row = (s * heads_kv + kh) * SPLITS + sp  # out [S, kvh, SPLITS, G_PAD, D], lse [.., G_PAD]
            tl.store(out_ptr + (row * G_PAD + g)[:, None] * D + d[None, :], out)
            tl.store(lse_ptr + row * G_PAD + g, lse)

    return decode_attention_kernel


def splits_for(slots: int, kv_heads: int, span: int, block: int = BLOCK_N) -> int:
    """Column splits per (slot, KV head): enough programs to fill the GPU, never an empty split by span."""
    wanted = math.ceil(MIN_PROGRAMS / max(1, slots * kv_heads))
    return max(1, min(wanted, math.ceil(span / block)))


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    span: int,
    scale: float,
    slot_of: torch.Tensor,
    write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Query row ``s`` of q ``[S, heads, D]`` against the first ``lengths[s]`` columns (``<= span``) of cache
    row ``slot_of[s]`` of ``keys`` and ``values`` ``[slots, kvh, L+1, D]`` (several rows may read one slot:
    a block of tokens being verified, each at its own position). With one split (enough programs without
    splitting the columns) it returns the attention ``[S, heads * D]`` in q's dtype and None; otherwise the
    splits' outputs ``[S, kvh, splits, G', D]`` and log-sum-exps ``[S, kvh, splits, G']`` (fp32; G' = the
    group size padded to 16) for ``combine``, which costs a kernel of its own.

    ``write``: (new keys, new values ``[S, kvh, D]``, positions ``[S]``): row ``s``'s key and value are
    stored at column ``positions[s]`` of its cache row (whatever the column: idle rows write the trash
    column) and attended to from registers, which saves the two index kernels a layer that writing the
    cache before the call costs (7% of a decode step). Only when no two rows read one cache row: a row
    would not see another's column, which its own kernel program stores."""
    rows, heads, dim = q.shape
    config = config or config_for(rows)
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    g_pad = max(16, triton_next_power_of_2(groups))
    block = config.block
    splits = config.splits or splits_for(rows, kv_heads, span, block)
    chunk = math.ceil(span / splits / block) * block
    direct = splits == 1
    if direct:
        out = torch.empty((rows, heads * dim), dtype=q.dtype, device=q.device)
        lse = out  # not written
    else:
        out = torch.empty((rows, kv_heads, splits, g_pad, dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((rows, kv_heads, splits, g_pad), dtype=torch.float32, device=q.device)
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("decode_attention needs the head dim contiguous in q, keys and values")
    new_k, new_v, positions = write if write is not None else (q, q, lengths)  # unread when not writing
    if new_k.stride(-1) != 1 or new_v.stride(-1) != 1:
        raise ValueError("decode_attention needs the head dim contiguous in the new keys and values")
    _kernel()[(rows, kv_heads, splits)](
        q,
        keys,
        values,
        lengths,
        slot_of,
        new_k,
        new_v,
        positions,
        out,
        lse,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        new_k.stride(0),
        new_k.stride(1),
        new_v.stride(0),
        new_v.stride(1),
        scale,
        chunk,
        SPLITS=splits,
        G=groups,
        G_PAD=g_pad,
        D=dim,
        BLOCK=block,
        WRITE=write is not None,
        DIRECT=direct,
        num_warps=config.warps,
        num_stages=config.stages,
    )
    return out, None if direct else lse


def combine(out: torch.Tensor, lse: torch.Tensor | None, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """The splits of ``decode_attention`` merged by their log-sum-exps: ``[S, heads * D]`` in ``dtype`` (the
    output as it is when the kernel ran one split)."""
    if lse is None:
        return out.to(dtype)
    weight = torch.exp(lse - lse.amax(dim=2, keepdim=True))  # [S, kvh, splits, G']
    merged = (out * weight[..., None]).sum(dim=2) / weight.sum(dim=2)[..., None]  # [S, kvh, G', D]
    return merged[:, :, :groups].reshape(out.shape[0], -1).to(dtype)


def triton_next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()
