"""FP8 features on the wire: float8_e4m3fn values with one fp32 scale per token and target layer.

``quantise`` runs on the producer's device right before the device-to-host copy, ``dequantise`` on the
worker's device right after the host-to-device copy, so the wire (and the host copies on both ends) move
1 byte per value instead of 2 (bf16) or 4 (fp32), plus 4 bytes per token and layer.

Scale = absmax / 448 (448 is e4m3fn's largest finite value) over the ``H`` values of one token's one layer,
computed in fp32; a row of zeros gets scale 0 and comes back as zeros. Error bound per value (see
``error_bound``): half a unit in the last place of e4m3 (3 mantissa bits: relative 2^-4) for normal values,
half the subnormal spacing (2^-10 * scale) below them. Non-finite inputs are not supported (a NaN or inf
in a row makes the whole row NaN); the target's hidden states are finite.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
_REL_ERR = 2.0**-4  # half an ulp at 3 mantissa bits
_SUB_ERR = 2.0**-10  # half the subnormal spacing (2^-9), in units of the scale


def quantise(features: torch.Tensor, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k*H] float -> (values [T, k*H] float8_e4m3fn, scales [T, k] float32), on the input's device."""
    if features.dim() != 2 or num_layers < 1 or features.shape[1] % num_layers:
        raise ValueError(
            f"features of shape {tuple(features.shape)} cannot be split into {num_layers} layers; "
            "expected [T, k*H] with k = the number of target layers"
        )
    t, width = features.shape
    rows = features.reshape(t, num_layers, width // num_layers).float()  # [T, k, H]
    scales = rows.abs().amax(dim=-1) / FP8_MAX if rows.numel() else rows.new_zeros(t, num_layers)  # [T, k]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = (rows / safe[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)  # out of range would become NaN
    return values.reshape(t, width), scales


def dequantise(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``quantise``: (values [T, k*H] fp8, scales [T, k] fp32) -> [T, k*H] in ``dtype``."""
    if values.dtype != FP8 or scales.dtype != torch.float32:
        raise ValueError(
            f"dequantise needs float8_e4m3fn values and float32 scales, got {values.dtype}, {scales.dtype}"
        )
    if values.dim() != 2 or scales.dim() != 2 or scales.shape[0] != values.shape[0]:
        raise ValueError(f"features {tuple(values.shape)} and scales {tuple(scales.shape)} do not match")
    t, width = values.shape
    k = scales.shape[1]
    if k < 1 or width % k:
        raise ValueError(f"features of width {width} cannot hold {k} layers of equal size")
    rows = values.reshape(t, k, width // k).float() * scales[..., None]  # [T, k, H]
    return rows.reshape(t, width).to(dtype)


def error_bound(features: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Largest |x - dequantise(quantise(x))| allowed per value: [T, k*H] float32."""
    t, width = features.shape
    k = scales.shape[1]
    x = features.reshape(t, k, width // k).float().abs()
    bound = torch.maximum(x * _REL_ERR, scales[..., None] * _SUB_ERR)
    return (bound * (1 + 1e-6)).reshape(t, width)  # fp32 rounding of the division and the product


def wire_features(features: torch.Tensor, num_layers: int, wire_dtype: str) -> dict[str, torch.Tensor]:
    """The BATCH tensors that carry ``features`` [T, k*H] in ``wire_dtype`` ("bf16": as they are; "fp8":
    "features" in e4m3 plus "feature_scales" [T, k]), still on the features' device."""
    if wire_dtype == "bf16":
        return {"features": features}
    if wire_dtype == "fp8":
        values, scales = quantise(features, num_layers)
        return {"features": values, "feature_scales": scales}
    raise ValueError(f"wire dtype {wire_dtype!r} is not one of bf16, fp8")


def read_features(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``wire_features`` on the worker (after the host-to-device copy): [T, k*H] features."""
    feats = tensors["features"]
    if feats.dtype != FP8:
        return feats
    if "feature_scales" not in tensors:
        raise ValueError("BATCH carries fp8 features without 'feature_scales'; producer and worker disagree")
    return dequantise(feats, tensors["feature_scales"], dtype)
