"""The dtype compute runs in on a device: bf16 on CUDA, fp32 elsewhere (CPU has no fast bf16 matmuls for
training, and the tests compare against fp32 references).

The target is loaded in it, the drafter trains under its autocast over fp32 master weights, FP8 features
are dequantised to it, and the evaluations build their drafter copies in it: one decision, read everywhere.
"""

from __future__ import annotations

import contextlib

import torch


def compute_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on a CUDA device, fp32 on any other."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """The training step's mixed precision: bf16 autocast on CUDA, nothing elsewhere (fp32 throughout)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=compute_dtype(device))
    return contextlib.nullcontext()
