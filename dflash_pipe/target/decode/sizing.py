"""How many slots the slot engine gets when ``regen.batch_size`` is 0 (auto).

A decode step reads every weight once whatever the batch, so on a GPU more slots are almost free tokens
(Qwen3-1.7B shape on an H200: 14.7K tokens/s at 64 slots, 26.7K at 256). What bounds them is memory: each
slot holds ``max_len`` tokens of keys and values (and a hybrid's recurrent state), allocated up front. Auto
takes a share of what is free once the target is loaded, less when drafter workers share its GPUs (they
allocate after the producer), and stops at ``AUTO_MAX_SLOTS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

AUTO_MAX_SLOTS = 256
"""Beyond this a step's attention (every slot's live keys) outgrows its weight reads: tokens/s flattens."""
FALLBACK_SLOTS = 32
"""Off a GPU (compute-bound: a larger batch buys little) and on the plain path."""
FREE_SHARE = 0.5
"""Of the device's free memory: the rest is for the producer's feature forwards and CUDA graph pools."""
SHARED_FREE_SHARE = 0.25
"""The same when drafter workers train on the target's GPUs (their memory is not taken yet)."""


@dataclass(frozen=True, slots=True)
class SlotSizing:
    slots: int
    why: str
    """One line for the log: the figures the choice came from."""


def free_bytes(device: torch.device) -> int:
    """Free device memory, counting what PyTorch's caching allocator holds but does not use."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def auto_slots(stack: Any, *, share: float = FREE_SHARE, free: int | None = None) -> SlotSizing:
    """The slot count for ``stack`` (a ``DecodeStack`` or ``HybridStack``): ``share`` of ``free`` bytes
    (default: what the device has free now) over one slot's cache, in [1, ``AUTO_MAX_SLOTS``]."""
    if stack.device.type != "cuda" and free is None:
        return SlotSizing(FALLBACK_SLOTS, f"{FALLBACK_SLOTS} slots (auto, off a GPU)")
    probe = stack.new_cache(1)
    per_slot = probe.nbytes
    del probe
    free = free_bytes(stack.device) if free is None else free
    fit = int(free * share) // per_slot
    slots = max(1, min(AUTO_MAX_SLOTS, fit))
    why = (
        f"{slots} slots (auto: {share:.0%} of {free / 2**30:.1f} GiB free on {stack.device}, "
        f"{per_slot / 2**20:.0f} MiB a slot of {stack.max_len} tokens"
    )
    if fit > AUTO_MAX_SLOTS:
        why += f", at most {AUTO_MAX_SLOTS}"
    elif fit < 1:
        why += ": not even one fits; lower --max-length or free the GPU"
    return SlotSizing(slots, why + ")")
