"""One GEMM where HF's decoder layer runs several on the same input: q/k/v, and the MLP's gate/up.

A decode step at batch 64 is ~200 small GEMMs whose weights are read once each; every GEMM launch has a
fixed cost and a partly idle tail, so fewer, wider GEMMs are a faster step (and a faster prefill). The
fused weight is one new tensor, and the HF modules' own weights become row views into it: no second copy
of the weights exists, and the model's own forward (the producer's feature forward) runs unchanged.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class FusedLayer:
    """The fused weights of one decoder layer; None where that part is not fused."""

    qkv_weight: torch.Tensor | None
    qkv_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor | None


_FUSED: weakref.WeakKeyDictionary[nn.Module, FusedLayer] = weakref.WeakKeyDictionary()
"""Per decoder layer: several stacks (regeneration, real evaluation) over one model fuse it once."""


def _linears(module: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    found = [getattr(module, name, None) for name in names]
    if not all(isinstance(m, nn.Linear) for m in found):
        return None
    linears: list[nn.Linear] = found  # type: ignore[assignment]
    first = linears[0].weight
    same = all(
        m.in_features == linears[0].in_features
        and m.weight.dtype == first.dtype
        and m.weight.device == first.device
        for m in linears
    )
    with_bias = {m.bias is not None for m in linears}
    return linears if same and len(with_bias) == 1 else None


@torch.no_grad()
def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenates the weights (and biases) by rows and points each module at its rows of the result."""
    weight = torch.cat([m.weight for m in linears], dim=0)
    bias = torch.cat([m.bias for m in linears], dim=0) if linears[0].bias is not None else None
    row = 0
    for m in linears:
        n = m.out_features
        m.weight.data = weight[row : row + n]
        if bias is not None:
            m.bias.data = bias[row : row + n]
        row += n
    return weight, bias


def fuse_layer(layer: nn.Module) -> FusedLayer:
    """The layer's fused weights, made on the first call. MLPs other than HF's gated one (down(act(gate(x))
    * up(x)), Qwen/Llama/Mistral), MoE blocks included, keep their own forward."""
    fused = _FUSED.get(layer)
    if fused is not None:
        return fused
    qkv = _linears(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
    qkv_weight, qkv_bias = _fuse(qkv) if qkv is not None else (None, None)
    mlp = layer.mlp
    gate_up = _linears(mlp, ("gate_proj", "up_proj"))
    gated = (
        gate_up is not None
        and gate_up[0].bias is None
        and isinstance(getattr(mlp, "down_proj", None), nn.Linear)
        and callable(getattr(mlp, "act_fn", None))
    )
    gate_up_weight = _fuse(gate_up)[0] if gated and gate_up is not None else None
    fused = FusedLayer(qkv_weight, qkv_bias, gate_up_weight)
    _FUSED[layer] = fused
    return fused
