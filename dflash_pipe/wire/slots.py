"""Memory a batch's payload lives in between the target's copy and the last worker's ACK, and its layout.

The target thread asks a ``PayloadStaging`` for a ``PayloadSlot`` big enough for one batch, copies the
wire tensors into it (laid out by ``slot_layout``), and hands the slot to the scheduler with the batch; the
scheduler releases it on the ACK (a lost worker's batch keeps its slot until the redelivered copy is
ACKed). Implementations decide where the bytes live: process-private host memory (``PrivateStaging``),
the shared-memory ring a same-host worker reads from (``wire.shm``), or the ring in the target GPU's
memory that same-host CUDA workers open (``wire.cuda_ipc``: its slots are device memory).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

SLOT_ALIGN = 64
"""Bytes; every tensor in a slot starts on this boundary."""


def slot_layout(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, int], int]:
    """Where each tensor starts when ``tensors`` are laid out back to back in one slot (``SLOT_ALIGN``
    apart), and the bytes the slot needs."""
    offsets, nbytes = {}, 0
    for name, t in tensors.items():
        offsets[name] = nbytes
        nbytes += -(-t.numel() * t.element_size() // SLOT_ALIGN) * SLOT_ALIGN
    return offsets, nbytes


@dataclass(slots=True)
class PayloadSlot:
    """``nbytes`` of host memory (pinned when CUDA is in use), or of GPU memory in the CUDA IPC ring;
    ``slot_id`` names it in a shared ring."""

    buffer: torch.Tensor  # uint8 [capacity], on the host or on the ring's GPU
    nbytes: int
    slot_id: int | None = None
    _on_release: Callable[[PayloadSlot], None] | None = None
    _released: bool = field(default=False, repr=False)

    def view(self, shape: tuple[int, ...], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        """The slot's bytes from ``offset`` as a tensor of ``shape`` and ``dtype`` (no copy)."""
        count = 1
        for dim in shape:
            count *= int(dim)
        size = count * torch.empty((), dtype=dtype).element_size()
        if offset + size > self.nbytes:
            raise ValueError(
                f"a {dtype} tensor of shape {shape} at offset {offset} overruns a {self.nbytes}-byte slot"
            )
        return self.buffer[offset : offset + size].view(dtype).view(shape)

    def views(self, like: Mapping[str, torch.Tensor], offsets: Mapping[str, int]) -> dict[str, torch.Tensor]:
        """A view of the slot for each tensor of ``like`` (its shape and dtype) at ``offsets[name]``."""
        return {name: self.view(tuple(t.shape), t.dtype, offsets[name]) for name, t in like.items()}

    def release(self) -> None:
        """Gives the memory back; safe to call twice (a duplicate ACK must not free a reused slot)."""
        if self._released:
            return
        self._released = True
        if self._on_release is not None:
            self._on_release(self)


class PayloadStaging(Protocol):
    def acquire(self, nbytes: int, timeout_s: float | None = None) -> PayloadSlot:
        """A slot of at least ``nbytes``; blocks while every slot is leased (back-pressure, never overwrite).

        Raises ``TimeoutError`` after ``timeout_s`` (None: wait forever)."""
        ...

    def close(self) -> None:
        """Frees every slot; called on every exit path."""
        ...


class PrivateStaging:
    """Fresh process-private buffers, pinned when CUDA is present so device-to-host copies run async."""

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._lock = threading.Lock()
        self.live = 0

    def acquire(self, nbytes: int, timeout_s: float | None = None) -> PayloadSlot:
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        with self._lock:
            self.live += 1
        return PayloadSlot(buffer=buffer, nbytes=nbytes, _on_release=self._forget)

    def _forget(self, _slot: PayloadSlot) -> None:
        with self._lock:
            self.live -= 1

    def close(self) -> None:
        pass
