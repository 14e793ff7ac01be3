"""The Gated DeltaNet mixer of Qwen3.5/3.6 (dense and MoE) and Qwen3-Next on a packed row, through kernels
that take the sample boundaries (``cu_seqlens``): flash-linear-attention's causal conv1d and chunked gated
delta rule on CUDA.

The forward is HF's (the same projections, gates, conv, delta rule with q/k L2-normalised in the kernel,
gated RMSNorm and output projection, read from the module's own parameters); only the two sequence kernels
change, so that neither the conv window nor the recurrent state crosses a sample boundary. ``fast_forward``
returns None (the per-sample path of ``dflash_pipe.target.hybrid`` then runs) whenever something differs
from what was proven: not on CUDA, ``fla`` not importable, an activation the conv kernel lacks, or a module
without the expected parameters. triton and fla are imported here lazily, on the GPU path only.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_pipe.target.hybrid import LINEAR_MIXERS, FastForward, Segments

log = logging.getLogger("dflash_pipe.target")

Conv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, str, Segments], torch.Tensor]
"""(x [1, T, D], weight [D, W], bias, activation, segments) -> silu(causal depthwise conv(x)) [1, T, D]."""
DeltaRule = Callable[..., torch.Tensor]
"""(q [1, T, Hk, K], k, v [1, T, Hv, V], g [1, T, Hv] log-decay, beta [1, T, Hv], segments) -> [1, T, Hv, V],
q and k L2-normalised inside, scale 1/sqrt(K), zero state at every segment start."""

_LAYOUT_PARAMS = {
    "qwen3_5": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    "qwen3_next": ("in_proj_qkvz", "in_proj_ba"),
}
_COMMON_PARAMS = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "head_k_dim", "head_v_dim", "key_dim")


@dataclass(frozen=True, slots=True)
class Kernels:
    """The two sequence kernels the packed forward calls."""

    name: str
    conv: Conv
    delta_rule: DeltaRule


@functools.cache
def fla_kernels() -> Kernels | None:
    """flash-linear-attention's varlen kernels, or None where ``fla`` does not import (a CPU install)."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:  # ImportError, or triton failing to find a GPU driver
        log.debug("flash-linear-attention not usable: %s: %s", type(exc).__name__, exc)
        return None

    def varlen(segments: Segments) -> dict[str, torch.Tensor]:
        return {"cu_seqlens": segments.cu_seqlens, "cu_seqlens_cpu": segments.cu_seqlens_cpu}

    def conv(x, weight, bias, activation, segments):
        return causal_conv1d(x, weight=weight, bias=bias, activation=activation, **varlen(segments))[0]

    def delta_rule(q, k, v, g, beta, segments):
        return chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, **varlen(segments)
        )[0]

    return Kernels(name="fla", conv=conv, delta_rule=delta_rule)


def linear_kernels(device: torch.device) -> Kernels | None:
    """The varlen kernels for a target on ``device``: flash-linear-attention on CUDA where it imports."""
    return fla_kernels() if device.type == "cuda" else None


def fast_forward(module: nn.Module, kernels: Kernels | None) -> FastForward | None:
    """The packed kernel forward for ``module``, or None where the per-sample path must run instead."""
    layout = LINEAR_MIXERS.get(type(module).__name__)
    if kernels is None or layout is None:
        return None
    missing = [n for n in (*_LAYOUT_PARAMS[layout], *_COMMON_PARAMS) if not hasattr(module, n)]
    if missing or getattr(module, "activation", None) not in ("silu", "swish"):
        log.info(
            "%s: %s; its packed forward runs per sample instead of through %s",
            type(module).__name__,
            f"no {missing}" if missing else f"activation {getattr(module, 'activation', None)!r}",
            kernels.name,
        )
        return None
    return functools.partial(packed_gated_deltanet, layout=layout, kernels=kernels)


def packed_gated_deltanet(
    module: nn.Module, hidden: torch.Tensor, segments: Segments, *, layout: str, kernels: Kernels
) -> torch.Tensor:
    """HF's Gated DeltaNet forward (no cache) on one packed row ``hidden [1, T, H]`` -> ``[1, T, H]``."""
    _, length, _ = hidden.shape
    if layout == "qwen3_5":
        mixed_qkv = module.in_proj_qkv(hidden)  # [1, T, 2*Kd + Vd]
        z = module.in_proj_z(hidden).reshape(1, length, -1, module.head_v_dim)  # [1, T, Hv, V]
        b, a = module.in_proj_b(hidden), module.in_proj_a(hidden)  # [1, T, Hv]
    else:  # qwen3_next: q, k, v, z, b, a interleaved per key head
        q, k, v, z, b, a = module.fix_query_key_value_ordering(
            module.in_proj_qkvz(hidden), module.in_proj_ba(hidden)
        )
        mixed_qkv = torch.cat([t.reshape(1, length, -1) for t in (q, k, v)], dim=-1)
    weight = module.conv1d.weight.squeeze(1)  # [D, W]
    mixed_qkv = kernels.conv(mixed_qkv, weight, module.conv1d.bias, module.activation, segments)  # [1, T, D]
    key_dim = module.key_dim
    query, key, value = torch.split(mixed_qkv, [key_dim, key_dim, mixed_qkv.shape[-1] - 2 * key_dim], dim=-1)
    query = query.reshape(1, length, -1, module.head_k_dim)  # [1, T, Hk, K]
    key = key.reshape(1, length, -1, module.head_k_dim)
    value = value.reshape(1, length, -1, module.head_v_dim)  # [1, T, Hv, V]
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)  # [1, T, Hv] fp32 log-decay
    core = kernels.delta_rule(query, key, value, g, beta, segments)  # [1, T, Hv, V]
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(1, length, -1))
