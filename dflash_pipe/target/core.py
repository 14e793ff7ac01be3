"""TargetCore: the frozen target LLM as a function from packed token batches to context features.

Knows models and tensors only (no sockets, threads or signals: the producer process wraps it).

Packed batches arrive as ``input_ids [T]`` plus per-sample ``lengths``. By default they run as ONE row
with position ids restarting per sample and attention blocked at sample boundaries (no padding computed);
``packing="padded"`` runs right-padded rows instead (the reference). Layouts live in
``dflash_pipe.target.packing``; the capture logic here does not depend on which one runs.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PreTrainedConfig

from dflash_pipe.compute.compile import FLEX_MIN_HEAD_DIM, compiler_errors
from dflash_pipe.diskspace import compile_cache_full
from dflash_pipe.target.families import (
    TargetPlan,
    UnsupportedTargetError,
    check_loaded,
    keep_language_model,
    plan_target,
)
from dflash_pipe.target.gated_deltanet import fast_forward, linear_kernels
from dflash_pipe.target.hybrid import Boundaries, Segments, describe, inspect_layers, wrap_mixers
from dflash_pipe.target.layers import find_decoder_layers, num_hidden_layers
from dflash_pipe.target.packing import (
    Attention,
    PackedLayout,
    Packing,
    PaddedLayout,
    check_lengths,
    compiled_layer_forward,
    plain_causal,
    register_flex_attention,
)
from dflash_pipe.target.placement import spread

log = logging.getLogger("dflash_pipe.target")


class _StopForward(Exception):
    """Raised by the hook on the last needed layer: later layers and the LM head never run."""


def _layer_output(output: object) -> torch.Tensor:
    """Decoder layers return a tensor (transformers 5) or a tuple whose first item is the hidden state."""
    return output[0] if isinstance(output, (tuple, list)) else output  # type: ignore[return-value]


class TargetCore:
    """A frozen HF causal LM that returns the outputs of selected decoder layers for packed batches."""

    def __init__(
        self,
        model_path: str | Path | PreTrainedConfig,
        layer_ids: Sequence[int],
        device: torch.device | str | Sequence[torch.device | str],
        dtype: torch.dtype,
        *,
        packing: Packing = "packed",
        attention: Attention | None = None,
        compile_layers: bool | None = None,
    ) -> None:
        """``model_path``: an HF model directory, or a config to build a randomly initialised target of that
        shape straight on ``device`` (benchmarks). ``device``: one device, or several to split the layers
        across (a target too big for one GPU).

        ``packing``: "packed" (one row, no padding) or "padded" (right-padded rows, the reference).
        ``attention`` (packed only): "flex" skips the masked tiles (compiled on CUDA), "sdpa" computes the
        dense ``[T, T]`` mask; None picks flex on CUDA when every layer is plain causal attention, else sdpa.
        ``compile_layers``: run every decoder layer through one torch.compile'd function (fused norms, RoPE
        and SwiGLU around the matmuls); None: on CUDA with packed flex attention. A compiler failure falls
        back to eager layers with one warning.
        """
        devices = [torch.device(d) for d in ([device] if isinstance(device, (str, torch.device)) else device)]
        self.device = devices[0]
        self.devices = devices
        self.dtype = dtype
        self.packing: Packing = packing
        config = (
            copy.deepcopy(model_path)  # from_config sets the attention implementation on the config it gets
            if isinstance(model_path, PreTrainedConfig)
            else AutoConfig.from_pretrained(str(model_path))
        )
        self.plan: TargetPlan = plan_target(config)  # refuses what is not a decoder-only LM
        if self.plan.padded_reason and packing == "packed":
            log.warning("target %s: packed rows are not exact here: %s", model_path, self.plan.padded_reason)
            self.packing = packing = "padded"
        self.attention: Attention = _pick_attention(
            packing, attention, config.get_text_config(), self.device, split=len(devices) > 1
        )
        implementation = self.plan.attn_implementation or (
            register_flex_attention() if self.attention == "flex" else "sdpa"
        )
        loader = self.plan.loader  # AutoModelForCausalLM, or the multimodal wrapper of a text model
        if isinstance(model_path, PreTrainedConfig):
            with torch.device(self.device if len(devices) == 1 else "cpu"):
                model = loader.from_config(config, dtype=dtype, attn_implementation=implementation)
            model_path = f"<random {type(config).__name__}>"
        else:
            # No device_map: that needs `accelerate`, which we do not depend on. Load on CPU, then move.
            model = loader.from_pretrained(str(model_path), dtype=dtype, attn_implementation=implementation)
        self.model_path = str(model_path)
        if freed := keep_language_model(model):  # a multimodal wrapper: only the text model stays
            log.info("target %s: only its language model is kept (freed: %s)", model_path, ", ".join(freed))
        model.eval().requires_grad_(False)
        self.model: nn.Module = model
        self.layers: nn.ModuleList = find_decoder_layers(model)  # first: it names unsupported models
        self._boundaries = Boundaries()
        self._hybrid = False  # linear-attention mixers wrapped: packed rows carry their boundaries
        self._layer_types: tuple[str, ...] | None = None
        self._setup_hybrid(model, config.get_text_config(), model_path)
        if len(devices) > 1:
            spread(model, self.layers, devices)
        else:
            model.to(self.device)
        self.config = model.config
        text_config = self.config.get_text_config()
        self.hidden_size: int = int(text_config.hidden_size)
        self.vocab_size: int = int(text_config.vocab_size)
        # The decoder stack without the LM head (e.g. Qwen3Model inside Qwen3ForCausalLM).
        self.decoder: nn.Module = model.get_decoder() if hasattr(model, "get_decoder") else model
        self.num_layers: int = num_hidden_layers(self.config) or len(self.layers)
        self.layer_ids: tuple[int, ...] = _validate_layer_ids(layer_ids, self.num_layers, model_path)
        if compile_layers is None:
            compile_layers = (
                self.device.type == "cuda" and self.attention == "flex" and self.packing == "packed"
            )
        self.compile_layers = compile_layers
        self._layer_compile_failed = False
        if compile_layers:
            for layer in self.layers:
                layer.forward = functools.partial(self._compiled_forward, layer)
        check_loaded(self)  # a few probe tokens: causal, and packed samples kept apart (else padded)

    def use_padded(self) -> None:
        """Runs right-padded rows from now on (the target's packed rows are not exact)."""
        if self.attention == "flex":  # the packed flex function needs a packed row's BlockMask
            switch = getattr(self.model, "set_attn_implementation", None)
            if switch is None:
                raise UnsupportedTargetError(
                    f"target {self.model_path}: packed rows are not exact and this transformers cannot switch "
                    'the loaded model to SDPA; build the TargetCore with packing="padded"'
                )
            switch("sdpa")
            self.attention = "sdpa"
        self.packing = "padded"

    def _setup_hybrid(self, model: nn.Module, text_config: object, name: object) -> None:
        """Linear-attention layers of a packed row get the sample boundaries (``dflash_pipe.target.hybrid``);
        a layer the packed path is not proven on turns the whole target to padded rows, with one warning."""
        plan = inspect_layers(text_config, self.layers)
        if self.packing != "packed":
            return
        if plan.unproven:
            log.warning(
                'target %s: %s; it runs on right-padded rows (packing="padded": exact, every pad position '
                "costs a token) instead of packed",
                name,
                plan.unproven,
            )
            self.packing = "padded"
            if self.attention == "flex":
                model.set_attn_implementation("sdpa")
                self.attention = "sdpa"
            return
        if not plan.hybrid:
            return
        kernels = linear_kernels(self.device)
        if self.device.type == "cuda" and kernels is None:
            log.warning(
                "target %s is a hybrid and flash-linear-attention is not importable: its linear-attention "
                "layers run per sample through transformers' torch fallback (exact, slow); install "
                "dflash-pipe[gpu]",
                name,
            )
        counts = wrap_mixers(plan, self._boundaries, lambda module: fast_forward(module, kernels))
        self._hybrid = True
        self._layer_types = tuple(getattr(text_config, "layer_types", None) or ()) or None
        log.info("target %s: %s", name, describe(counts))

    @property
    def layers_compiled(self) -> bool:
        """Whether the decoder layers run compiled (asked for, and the compiler has not failed)."""
        return self.compile_layers and not self._layer_compile_failed

    def _compiled_forward(self, layer: nn.Module, *args: object, **kwargs: object) -> object:
        """The layer through the shared compiled function; eager (with one warning) once that fails. Calls
        with a KV cache (regeneration's decoding, ``dflash_pipe.target.generate``) run eager: the compiled
        graph is the cache-less feature forward."""
        if not self._layer_compile_failed and _no_cache(kwargs):
            try:
                return compiled_layer_forward(layer, *args, **kwargs)
            except compiler_errors() as exc:
                if (full_disk := compile_cache_full(exc)) is not None:  # eager would hide a full disk
                    raise full_disk from None
                self._layer_compile_failed = True
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                log.warning(
                    "torch.compile of the target's decoder layers failed (%s: %s); they run uncompiled from "
                    "now on (same features, lower throughput)",
                    type(exc).__name__,
                    first,
                )
        return type(layer).forward(layer, *args, **kwargs)

    @property
    def feature_size(self) -> int:
        """k*H, the width of one feature row."""
        return len(self.layer_ids) * self.hidden_size

    @torch.inference_mode()
    def features(self, input_ids: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """Outputs of decoder layers ``layer_ids`` (``hidden_states[id + 1]``) for packed samples.

        ``input_ids [T]`` on any device; returns ``[T, k*H]`` in ``dtype`` on ``device``. Each selected
        layer's output is packed straight into its slice of the result by a forward hook (no full
        hidden-state list is kept), and the hook on the deepest selected layer aborts the forward. The
        LM head never runs; the final layer, if selected, comes from the decoder's normed output because
        that is what ``hidden_states[L]`` holds in HF.
        """
        lens = check_lengths(input_ids, lengths)
        layout = self._layout(input_ids, lens)
        hidden = self.hidden_size
        out = torch.empty(sum(lens), self.feature_size, dtype=self.dtype, device=self.device)  # [T, k*H]
        slots = {layer_id: j for j, layer_id in enumerate(self.layer_ids)}
        final = self.num_layers - 1
        # hidden_states[L] is the *normed* output of the last layer: take it from the decoder's output.
        hooked = [i for i in self.layer_ids if i != final]
        stop_after = None if final in slots else max(hooked)

        def make_hook(layer_id: int):
            def hook(_module: nn.Module, _args: object, output: object) -> None:
                j = slots[layer_id]
                out[:, j * hidden : (j + 1) * hidden] = layout.pack(
                    _layer_output(output).to(out.device)
                )  # [T, H]
                if layer_id == stop_after:
                    raise _StopForward

            return hook

        handles = [self.layers[i].register_forward_hook(make_hook(i)) for i in hooked]
        try:
            with self._boundaries.active(self._segments(layout)):
                result = self.decoder(**layout.model_inputs(), use_cache=False)
        except _StopForward:
            result = None
        finally:
            for handle in handles:
                handle.remove()
        if final in slots:
            j = slots[final]
            last_hidden = getattr(result, "last_hidden_state", None)
            if last_hidden is None:
                last_hidden = result[0]
            out[:, j * hidden : (j + 1) * hidden] = layout.pack(last_hidden.to(out.device))  # [T, H]
        elif result is not None:
            raise RuntimeError(
                f"{type(self.model).__name__} finished its forward without running decoder layer "
                f"{stop_after}; the layer list found by dflash_pipe.target.layers is not the one it uses"
            )
        return out

    @torch.inference_mode()
    def greedy_next(self, input_ids: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """The target's greedy next token at every packed position (``[T]`` int64), for acceptance eval.

        Runs the full model including the LM head, so it is much costlier than ``features``.
        """
        lens = check_lengths(input_ids, lengths)
        layout = self._layout(input_ids, lens)
        with self._boundaries.active(self._segments(layout)):
            logits = self.model(**layout.model_inputs(), use_cache=False).logits  # [B, S, V] or [1, T, V]
        return layout.pack(logits.argmax(dim=-1).to(self.device))  # [T]

    def _layout(self, input_ids: torch.Tensor, lengths: list[int]) -> PackedLayout | PaddedLayout:
        if self.packing == "padded":
            return PaddedLayout.build(input_ids, lengths, self.device)
        compile = self.device.type == "cuda"
        return PackedLayout.build(
            input_ids, lengths, self.device, self.attention, compile=compile, layer_types=self._layer_types
        )

    def _segments(self, layout: PackedLayout | PaddedLayout) -> Segments | None:
        """The row's sample boundaries for the linear-attention layers (hybrid targets, packed rows only)."""
        if not self._hybrid or not isinstance(layout, PackedLayout):
            return None
        return Segments.build(layout.lengths, self.device)


def _no_cache(kwargs: dict) -> bool:
    """A layer call without a KV cache (the cache's keyword changed name within transformers 5)."""
    return kwargs.get("past_key_values") is None and kwargs.get("cache") is None


def _pick_attention(
    packing: Packing,
    attention: Attention | None,
    text_config: object,
    device: torch.device,
    *,
    split: bool = False,
) -> Attention:
    """flex where it is known to work (packed rows of plain causal layers, head_dim >= 16, one device: the
    BlockMask's mask function reads a tensor of the first device), else SDPA."""
    if packing not in ("packed", "padded"):
        raise ValueError(f'packing must be "packed" or "padded", got {packing!r}')
    if attention not in (None, "flex", "sdpa"):
        raise ValueError(f'attention must be "flex", "sdpa" or None (pick), got {attention!r}')
    fits = plain_causal(text_config)
    head_dim = _head_dim(text_config)
    if attention == "flex" and (packing == "padded" or not fits):
        why = (
            "padded rows use sdpa"
            if packing == "padded"
            else "the model has sliding-window or soft-capped layers, or is a hybrid whose attention layers "
            "flex is not proven on (dflash_pipe.target.packing.FLEX_HYBRIDS)"
        )
        raise ValueError(
            f'attention="flex" needs packing="packed" and plain causal layers ({why}); use "sdpa"'
        )
    if attention == "flex" and device.type == "cuda" and head_dim < FLEX_MIN_HEAD_DIM:
        raise ValueError(
            f'attention="flex" on CUDA needs head_dim >= {FLEX_MIN_HEAD_DIM} (compiled flex_attention kernels), '
            f'this model has {head_dim}; use "sdpa"'
        )
    if attention == "flex" and split:
        raise ValueError(
            'attention="flex" needs the target on one device (its block mask lives on the first); a target '
            'split across devices uses "sdpa"'
        )
    if attention is None:
        flex_ok = (
            packing == "packed"
            and fits
            and device.type == "cuda"
            and head_dim >= FLEX_MIN_HEAD_DIM
            and not split
        )
        attention = "flex" if flex_ok else "sdpa"
    return attention


def _head_dim(text_config: object) -> int:
    """The attention head size; 0 for a model without attention heads (e.g. Mamba: no flex then)."""
    explicit = getattr(text_config, "head_dim", None)
    heads = getattr(text_config, "num_attention_heads", None)
    return int(explicit or (text_config.hidden_size // heads if heads else 0))


def _validate_layer_ids(layer_ids: Sequence[int], num_layers: int, model_path: str | Path) -> tuple[int, ...]:
    ids = tuple(layer_ids)
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers]
    if not ids or bad:
        raise ValueError(
            f"layer_ids {list(ids)} are invalid for the target {model_path} with {num_layers} decoder layers"
            + (f" (out of range: {bad})" if bad else " (empty)")
            + f"; pick distinct ids in 0..{num_layers - 1}, e.g. the drafter's target_layer_ids from "
            "DrafterConfig.from_target"
        )
    if len(set(ids)) != len(ids):
        raise ValueError(
            f"layer_ids {list(ids)} contain duplicates; pick distinct ids in 0..{num_layers - 1}"
        )
    return ids
