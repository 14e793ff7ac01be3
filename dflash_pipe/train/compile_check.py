"""The compiled training step checked against an eager one before training starts, with a fallback.

``train.compile=full`` (the default on CUDA) hands whole decoder layers and the CE terms to Inductor. A
compiler *failure* already falls back inside ``train.build.CompiledLayers``, but a wrong kernel, or one that
fails only when it runs (torch 2.11 once raised a shape error from a split reduction at run time), would
not. So after its warm-up each worker runs one synthetic batch (of a shape the warm-up compiled) through the
compiled step and through ``DFlashDrafter.reference()`` (eager, attention through SDPA with the dense mask:
another kernel than flex's) and compares the loss and the whole gradient. On a disagreement or a run-time error it
re-applies compile with less (``train.build.apply_attention_only``: ``train.compile=attention``), warms
that up, trains on with it, warns, and reports ``compile_fallback`` with its warm-up metrics.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from dflash_pipe.compute.compile import backward_with_settings
from dflash_pipe.compute.precision import autocast
from dflash_pipe.diskspace import compile_cache_full
from dflash_pipe.drafter import DFlashDrafter
from dflash_pipe.train.build import apply_attention_only
from dflash_pipe.train.warmup import synthetic_batch, warm_up, warmup_lengths

LOSS_TOLERANCE = 1e-2
GRAD_TOLERANCE = 5e-2
"""bf16 bounds, relative to the eager step. The H200 sweep (docs/performance.md) measured at most 2.3e-5 on
the loss and 1.2e-2 on any one gradient between a correct compiled step and this reference."""


@dataclass(frozen=True, slots=True)
class CompileCheck:
    loss_rel: float
    grad_rel: float
    error: str | None = None  # a run-time error of the compiled step

    @property
    def ok(self) -> bool:
        return self.error is None and self.loss_rel <= LOSS_TOLERANCE and self.grad_rel <= GRAD_TOLERANCE

    def describe(self) -> str:
        if self.error:
            return f"the compiled step failed at run time ({self.error})"
        return (
            f"the compiled step disagrees with the eager one (loss {self.loss_rel:.2e} relative, bound "
            f"{LOSS_TOLERANCE:g}; gradient {self.grad_rel:.2e}, bound {GRAD_TOLERANCE:g})"
        )


def _loss_and_grads(
    model: DFlashDrafter, batch: tuple[torch.Tensor, ...]
) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    device = batch[0].device
    with autocast(device):
        out = model(*batch, generator=torch.Generator(device=device).manual_seed(0))
    backward_with_settings(out.loss_sum)
    grads = [p.grad for p in model.trainable_parameters()]
    return float(out.loss_sum.detach()), [g if g is not None else torch.zeros(()) for g in grads]


def check_compiled(
    model: DFlashDrafter, drafter_config: dict[str, Any], device: torch.device, length: int
) -> CompileCheck:
    """One synthetic batch of 2 samples of ``length`` tokens, the second a quarter shorter (right padding),
    through the compiled step and through ``model.reference()``: the loss and the whole gradient (all
    trainable tensors as one vector), each relative to the reference's. ``length``: one the warm-up ran,
    so the check compiles nothing new (Inductor's size thresholds make a smaller batch another variant)."""
    batch = synthetic_batch(drafter_config, device, 2, length)
    batch[2][1, length * 3 // 4 :] = False
    try:
        loss, grads = _loss_and_grads(model, batch)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as exc:
        return CompileCheck(
            math.nan, math.nan, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        )
    compiled = grads  # kept aside: the reference's backward (after zero_grad) makes new gradient tensors
    with model.reference():
        ref_loss, ref_grads = _loss_and_grads(model, batch)
    pairs = zip(compiled, ref_grads, strict=True)
    diff = math.sqrt(sum(float((c.float() - r.float()).square().sum()) for c, r in pairs))
    norm = math.sqrt(sum(float(r.float().square().sum()) for r in ref_grads))
    model.zero_grad(set_to_none=True)
    return CompileCheck(abs(loss - ref_loss) / max(abs(ref_loss), 1e-30), diff / max(norm, 1e-30))


def warm_up_checked(model: DFlashDrafter, *, full: bool, **warm_kwargs: Any) -> dict[str, float]:
    """``warm_up(model, **warm_kwargs)``; with ``full`` (``train.compile=full``), then the check, and on a
    failure the fallback to compiled attention only, warmed up in turn. The metrics say what happened. A
    compile cache on a full disk is ``DiskFullError``, never a fallback (the fallback would fail alike)."""
    try:
        return _warm_up_checked(model, full=full, **warm_kwargs)
    except Exception as exc:
        if (full_disk := compile_cache_full(exc)) is not None:
            raise full_disk from None
        raise


def _warm_up_checked(model: DFlashDrafter, *, full: bool, **warm_kwargs: Any) -> dict[str, float]:
    if not full:
        return warm_up(model, **warm_kwargs)
    try:
        metrics = warm_up(model, **warm_kwargs)
        length = warmup_lengths(warm_kwargs["seq_len"])[-1]  # the warm-up's shortest: the least memory
        check = check_compiled(model, warm_kwargs["drafter_config"], warm_kwargs["device"], length)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as exc:  # a compiled kernel failing while it runs, within the warm-up itself
        if compile_cache_full(exc) is not None:
            raise
        metrics, check = {}, CompileCheck(math.nan, math.nan, f"{type(exc).__name__}: {str(exc)[:200]}")
    if check.error is None:  # a failed step has no figures (and metrics.jsonl no NaN)
        metrics.update(compile_check_loss_rel=check.loss_rel, compile_check_grad_rel=check.grad_rel)
    if check.ok:
        return {**metrics, "compile_fallback": 0.0}
    warnings.warn(
        f"train.compile=full: {check.describe()} on torch {torch.__version__}; this worker trains on with "
        "train.compile=attention (flex attention compiled with Inductor's own tiles, the layers eager: "
        "slower steps, right results). Please report it with the shapes in config.json; set --compile "
        "attention to skip the attempt.",
        RuntimeWarning,
        stacklevel=2,
    )
    apply_attention_only(model)
    return {**metrics, **warm_up(model, **warm_kwargs), "compile_fallback": 1.0}
