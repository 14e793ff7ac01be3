"""Where the target runs: one replica per GPU when it fits, else one replica split across the GPUs.

Replicas are the fast layout (every GPU computes its own batches, no cross-GPU traffic). A target too big
for one GPU is split by decoder layers across all target GPUs (each layer moves its inputs to its own
device), a sequential pipeline that trades speed for fitting at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

Parallel = Literal["auto", "replicas", "split"]
HEADROOM = 1.3
"""Weights x this must fit in one GPU's memory for a replica: activations and the CUDA context need room."""


def weight_bytes(model_path: str | Path, dtype: torch.dtype) -> int:
    """The target's weight size once loaded in ``dtype``, from its config (no weights are read)."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(str(model_path)).get_text_config()
    h, layers, vocab = int(text.hidden_size), int(text.num_hidden_layers), int(text.vocab_size)
    inter = int(getattr(text, "intermediate_size", 4 * h))
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or h // heads)
    per_layer = h * head_dim * (2 * heads + 2 * kv) + 3 * h * inter
    embeddings = vocab * h * (1 if getattr(text, "tie_word_embeddings", False) else 2)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (layers * per_layer + embeddings) * itemsize


def plan_replicas(
    devices: Sequence[str], *, weights: int, memory: Callable[[str], int], mode: Parallel = "auto"
) -> list[list[str]]:
    """Groups of devices, one group per target replica.

    ``memory(device)`` gives a device's total bytes. ``auto`` picks replicas when the weights (with
    headroom) fit the smallest device, else one split replica over all of them.
    """
    if mode not in ("auto", "replicas", "split"):
        raise ValueError(f"--target-parallel must be auto, replicas or split, got {mode!r}.")
    devices = list(devices)
    if mode == "auto":
        fits = all(d == "cpu" or weights * HEADROOM <= memory(d) for d in devices)
        mode = "replicas" if fits or len(devices) == 1 else "split"
    return [[d] for d in devices] if mode == "replicas" else [devices]


def cuda_memory(device: str) -> int:
    return torch.cuda.get_device_properties(torch.device(device)).total_memory


def spread(model: nn.Module, layers: nn.ModuleList, devices: Sequence[torch.device]) -> None:
    """Moves a CPU-loaded model onto ``devices``: contiguous runs of decoder layers per device, the rest
    (embeddings, final norm, LM head) on the first. Every module that can receive another device's output
    gets a pre-hook that moves its inputs to its own device."""
    first = devices[0]
    in_layers = {id(m) for layer in layers for m in layer.modules()}
    for i, layer in enumerate(layers):
        device = devices[i * len(devices) // len(layers)]
        layer.to(device)
        layer.register_forward_pre_hook(_inputs_to(device), with_kwargs=True)
    for module in model.modules():
        if id(module) in in_layers:
            continue
        for param in module.parameters(recurse=False):
            param.data = param.data.to(first)
        for name, buf in module.named_buffers(recurse=False):
            module._buffers[name] = buf.to(first)
        if _is_leafish(module):
            module.register_forward_pre_hook(_inputs_to(first), with_kwargs=True)


def _is_leafish(module: nn.Module) -> bool:
    """Modules with their own weights (norms, embeddings, heads) are where cross-device inputs arrive."""
    return any(True for _ in module.parameters(recurse=False))


def _inputs_to(device: torch.device) -> Callable[..., Any]:
    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _to(args, device), _to(kwargs, device)

    return hook


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True) if value.device != device else value
    if isinstance(value, BlockMask):  # a packed batch's flex mask goes wherever its layer runs
        return value.to(device) if value.kv_num_blocks.device != device else value
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value
