"""FP8 features: round trip within e4m3's bound, exact scales, zeros and extreme values."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.wire.fp8 import FP8, FP8_MAX, dequantise, error_bound, quantise


def test_round_trip_within_the_e4m3_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 3 * 64, generator=g) * torch.logspace(-3, 3, 37)[:, None]  # [T, k*H]
    q, s = quantise(x, 3)
    assert q.dtype == FP8 and q.shape == x.shape and s.shape == (37, 3) and s.dtype == torch.float32
    back = dequantise(q, s, torch.float32)
    err = (back - x).abs()
    assert bool((err <= error_bound(x, s)).all()), float((err - error_bound(x, s)).max())
    assert float(err.max()) > 0  # it is lossy: a test that cannot fail would pass with a no-op


def test_scales_are_bit_exact_absmax_over_448():
    x = torch.randn(5, 2 * 8, dtype=torch.float32)
    _, s = quantise(x, 2)
    expected = x.reshape(5, 2, 8).abs().amax(-1) / 448.0
    assert torch.equal(s.view(torch.int32), expected.view(torch.int32))
    # each token-layer's largest magnitude maps to exactly +-448
    q, _ = quantise(x, 2)
    assert torch.equal(q.float().reshape(5, 2, 8).abs().amax(-1), torch.full((5, 2), FP8_MAX))


def test_zeros_and_empty():
    x = torch.zeros(4, 6)
    x[1, 3:] = 2.0  # second layer of token 1 is non-zero, everything else zero
    q, s = quantise(x, 2)
    assert s[0].tolist() == [0.0, 0.0] and s[1, 0] == 0.0 and s[1, 1] == 2.0 / 448
    assert torch.equal(dequantise(q, s, torch.float32), x)
    q, s = quantise(torch.zeros(0, 8), 2)
    assert q.shape == (0, 8) and s.shape == (0, 2)
    assert dequantise(q, s, torch.bfloat16).shape == (0, 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_extreme_values(dtype):
    big = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).tiny
    x = torch.tensor([[big, -big, 1.0, 0.0], [tiny, -tiny, tiny * 4, 0.0]], dtype=dtype)
    q, s = quantise(x, 1)
    assert not torch.isnan(q.float()).any()
    back = dequantise(q, s, torch.float32)
    assert bool(((back - x.float()).abs() <= error_bound(x, s)).all())
    assert torch.allclose(back[0, :2], x[0, :2].float(), rtol=1e-6, atol=0)  # absmax survives (fp32 rounding)


def test_bf16_output_and_mismatches_raise():
    x = torch.randn(3, 8).to(torch.bfloat16)
    q, s = quantise(x, 2)
    assert dequantise(q, s, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="cannot be split into 3 layers"):
        quantise(x, 3)
    with pytest.raises(ValueError, match="do not match"):
        dequantise(q, s[:2], torch.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn values"):
        dequantise(q.float(), s, torch.float32)
