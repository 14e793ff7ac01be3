"""The compile policy the target and the drafter both read: Dynamo's limits, Inductor's options, what
counts as a compiler failure (callers fall back to eager), the head-dim floor of flex kernels and the
flex tiles the drafter asks for where Inductor's defaults are slow.

Dynamo's config is per thread since torch 2.12, so every thread that may compile (the producer's target
threads, each drafter thread, autograd's backward threads) applies ``DYNAMO_SETTINGS`` itself.
"""

from __future__ import annotations

import torch

DYNAMO_SETTINGS: dict[str, object] = {
    "recompile_limit": 64,
    "accumulated_recompile_limit": 1024,
}
"""Applied in every thread that may compile. Dynamic shapes still compile a few variants per function
(sizes 0/1 specialise, grad mode, devices); the default limit of 8 would silently fall back to eager."""

INDUCTOR_OPTIONS = {"triton.coalesce_tiling_analysis": False}
"""For the drafter's dynamic-shape compiles (layers, CE terms): Inductor's coalescing tiling analysis
asserted on a layer graph on torch 2.11 (an H 2048 drafter at 2048 tokens); by its own note it does not
apply to dynamic shapes anyway."""

FLEX_MIN_HEAD_DIM = 16
"""Inductor's flex_attention kernels refuse smaller head dims ("NYI: embedding dimension ... at least 16");
below it the automatic attention choice is SDPA (tiny test and demo-sized models)."""


FLEX_SM90_WIDE_HEAD_TILES: dict[str, int] = {
    "fwd_BLOCK_M": 128,
    "fwd_BLOCK_N": 64,
    "fwd_num_warps": 8,
    "fwd_num_stages": 2,
    "bwd_BLOCK_M1": 64,
    "bwd_BLOCK_N1": 64,
    "bwd_BLOCK_M2": 64,
    "bwd_BLOCK_N2": 64,
    "bwd_num_warps": 8,
    "bwd_num_stages": 2,
}
"""The drafter's flex tiles for 128 < head_dim <= 256 on sm90 (H100/H200). Inductor's defaults there (64 x 64,
4 warps in the backward) are slow at head_dim 256: the backward ran at six times the forward in the
Qwen3.6-27B drafter's step. Measured at that shape (``bench/flex_configs.py``, H200, torch 2.11): forward
5.2 -> 3.6 ms, backward 28.6 -> 21.6 ms a layer; 128-key tiles in the backward need more shared memory than
sm90 has."""


def flex_kernel_options(head_dim: int, device: torch.device) -> dict[str, int] | None:
    """``kernel_options`` for the drafter's flex_attention calls; None keeps Inductor's own choice."""
    if device.type != "cuda" or not 128 < head_dim <= 256:
        return None
    return dict(FLEX_SM90_WIDE_HEAD_TILES) if torch.cuda.get_device_capability(device) == (9, 0) else None


def compiler_errors() -> tuple[type[BaseException], ...]:
    """What torch.compile raises when Dynamo or Inductor fails on a graph (callers fall back to eager)."""
    import torch._dynamo.exc
    import torch._inductor.exc

    return (torch._dynamo.exc.BackendCompilerFailed, torch._inductor.exc.InductorError)


def apply_dynamo_settings() -> None:
    """Sets ``DYNAMO_SETTINGS`` for the calling thread (overrides are per thread since torch 2.12)."""
    import torch._dynamo

    for name, value in DYNAMO_SETTINGS.items():
        if not hasattr(torch._dynamo.config, name):
            raise RuntimeError(
                f"torch._dynamo.config has no {name!r} in torch {torch.__version__}; dflash-pipe supports "
                "torch 2.11 and later."
            )
        setattr(torch._dynamo.config, name, value)


def backward_with_settings(loss: torch.Tensor) -> None:
    """``loss.backward()``, with the Dynamo settings applied first on whichever thread autograd runs the
    graph (a CUDA device's autograd thread, or this one on CPU)."""
    if loss.grad_fn is not None:
        handle = loss.grad_fn.register_prehook(lambda _grads: apply_dynamo_settings())
        try:
            loss.backward()
        finally:
            handle.remove()
    else:
        loss.backward()
