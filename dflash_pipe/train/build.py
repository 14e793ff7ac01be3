"""Build the drafter eager, then apply activation checkpointing and compile to it (torchtitan's
``parallelize`` order): the one builder the worker and the benches call.

The drafter's ``forward`` decides nothing about compile or checkpointing; it runs what was applied:
``model.checkpointing`` (a ``CheckpointPolicy``, which wraps each layer and the loss) and
``model.kernels`` (a ``Kernels``: which function runs a layer, whether the flex kernel and the CE terms
are compiled). Applying again replaces what was there, so the compile check's fallback re-applies with
less (``apply_attention_only``) instead of flipping flags on a live model.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

from dflash_pipe.compute.compile import INDUCTOR_OPTIONS, compiler_errors
from dflash_pipe.config.train import TrainConfig
from dflash_pipe.drafter import CheckpointPolicy, DFlashDrafter, DrafterConfig
from dflash_pipe.drafter.compile_guard import needs_compile
from dflash_pipe.drafter.model import DFlashLayer, Kernels, run_layer

CompilePlan = Literal["off", "attention", "full"]
"""``TrainConfig.compile_plan``: nothing, the flex attention (and SDPA layers), or layers and CE too."""


@functools.cache
def _compiled_layer() -> Callable[..., Tensor]:
    """One compiled function for every draft layer: the layer's weights are inputs, not constants, and a
    fresh ``attend`` closure each step reuses the graph (its mask is an input too)."""
    return torch.compile(run_layer, dynamic=True, options=INDUCTOR_OPTIONS)


class CompiledLayers:
    """``Kernels.layer`` with the layers compiled whole, so Inductor fuses the norms, RoPE and SwiGLU around
    the matmuls. If Inductor fails on them, this model's layers run eagerly (around the compiled attention)
    from then on, with one warning, instead of the run dying on a compiler bug."""

    def __init__(self) -> None:
        self.failed = False

    def __repr__(self) -> str:
        return f"CompiledLayers(failed={self.failed})"

    def __call__(self, layer: DFlashLayer, x: Tensor, ctx: Tensor, rope_q, rope_k, attend) -> Tensor:
        if not self.failed:
            try:
                return _compiled_layer()(layer, x, ctx, rope_q, rope_k, attend)
            except compiler_errors() as exc:
                if needs_compile(exc):  # threaded mode's guard asks for an exclusive re-run: not a failure
                    raise
                self.failed = True
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                warnings.warn(
                    f"torch.compile of the drafter layers failed ({type(exc).__name__}: {first}); they run "
                    "uncompiled from now on (slower steps, same results). Set --compile attention to skip the "
                    "attempt, or report it with your torch version.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return run_layer(layer, x, ctx, rope_q, rope_k, attend)


def apply_checkpointing(model: DFlashDrafter, policy: CheckpointPolicy) -> DFlashDrafter:
    """Recompute in backward what ``policy`` says (its ``run_layer`` / ``run_loss`` wrap each layer and the
    LM-head loss); replaces any policy applied before. The same math: only memory and time change."""
    model.checkpointing = policy
    return model


def apply_compile(
    model: DFlashDrafter,
    *,
    attention: bool,
    layers: bool,
    fused_ce: bool = False,
    tuned_tiles: bool = True,
) -> bool:
    """Sets what ``model`` runs compiled, replacing what was applied before; whether anything is.

    ``attention``: the flex block mask and kernel (``tuned_tiles``: with ``flex_kernel_options``, else
    Inductor's own); ``layers``: each decoder layer whole (``CompiledLayers``); ``fused_ce``: the LM head's
    softmax/CE terms as one kernel. Dynamo's limits are set by ``compute.compile.apply_dynamo_settings`` in
    each thread that trains."""
    model.kernels = Kernels(
        layer=CompiledLayers() if layers else run_layer,
        compile_attention=attention,
        tuned_flex_tiles=tuned_tiles,
        fused_ce=fused_ce,
    )
    return attention or layers


def apply_compile_plan(
    model: DFlashDrafter, plan: CompilePlan, device: torch.device, *, layers: bool | None = None
) -> bool:
    """``train.compile``'s plan on ``model`` (on ``device``); whether anything is compiled. ``full``: attention,
    layers and CE terms (the default on CUDA; docs/performance.md has the shape sweep behind it);
    ``attention``: the flex attention, or on the SDPA path the layers; ``off``: nothing. ``layers``
    overrides the layers' choice (the compile bench compiles them on CPU)."""
    full, compile_on = plan == "full", plan != "off"
    if layers is None:
        layers = full or (compile_on and model.backend(device) == "sdpa")
    return apply_compile(model, attention=compile_on, layers=layers, fused_ce=full)


def apply_attention_only(model: DFlashDrafter) -> None:
    """The fallback of ``train.compile=full`` (``train.compile_check``): compile re-applied with less, the
    layers and CE terms eager, the flex attention and block mask compiled with Inductor's own tiles."""
    apply_compile(model, attention=True, layers=False, fused_ce=False, tuned_tiles=False)


def build_drafter(
    drafter_cfg: DrafterConfig,
    train_cfg: TrainConfig,
    embed: nn.Embedding,
    head: nn.Linear,
    device: torch.device,
    *,
    checkpointing: CheckpointPolicy | None = None,
    compile_layers: bool | None = None,
) -> tuple[DFlashDrafter, bool]:
    """The drafter on ``device`` in train mode: built eager, then checkpointed and compiled as
    ``train.activation_checkpointing`` (or ``checkpointing``) and ``train.compile`` say; and whether
    anything is compiled. ``compile_layers``: as ``apply_compile_plan``'s ``layers``."""
    model = DFlashDrafter(drafter_cfg, embed, head).to(device).train()
    apply_checkpointing(model, checkpointing or CheckpointPolicy(train_cfg.activation_checkpointing))
    plan = train_cfg.compile_plan(device.type)
    return model, apply_compile_plan(model, plan, device, layers=compile_layers)
