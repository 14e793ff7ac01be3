"""Host memory that features land in when they leave the target GPU, held until every worker ACKs them.

The target thread asks a ``HostStaging`` for a ``HostSlot`` big enough for one batch, copies the features
into it, and hands the slot to the scheduler with the batch; the scheduler releases it on the ACK (a lost
worker's batch keeps its slot until the redelivered copy is ACKed). Implementations decide where the bytes
live: process-private memory (``PrivateStaging``), a shared-memory ring a same-host worker reads from, or
a ring in the target GPU's memory that same-host CUDA workers open (``wire.cuda_ipc``; despite the name,
its slots are device memory).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(slots=True)
class HostSlot:
    """``nbytes`` of host memory (pinned when CUDA is in use), or of GPU memory in the CUDA IPC ring;
    ``slot_id`` names it in a shared ring."""

    buffer: torch.Tensor  # uint8 [capacity] on the host
    nbytes: int
    slot_id: int | None = None
    _on_release: Callable[[HostSlot], None] | None = None
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

    def release(self) -> None:
        """Gives the memory back; safe to call twice (a duplicate ACK must not free a reused slot)."""
        if self._released:
            return
        self._released = True
        if self._on_release is not None:
            self._on_release(self)


class HostStaging(Protocol):
    def acquire(self, nbytes: int, timeout_s: float | None = None) -> HostSlot:
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

    def acquire(self, nbytes: int, timeout_s: float | None = None) -> HostSlot:
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        with self._lock:
            self.live += 1
        return HostSlot(buffer=buffer, nbytes=nbytes, _on_release=self._forget)

    def _forget(self, _slot: HostSlot) -> None:
        with self._lock:
            self.live -= 1

    def close(self) -> None:
        pass
