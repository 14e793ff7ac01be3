"""Slot bookkeeping shared by the same-host payload rings: ``wire.shm`` (host memory) and ``wire.cuda_ipc``
(device memory).

A ring is one buffer cut into ``slots`` slots of ``slot_bytes``. On the producer it is a ``PayloadStaging``
(``acquire`` a slot, write a batch into it, ``release`` it on the ACK); on both sides it is the
``codec.SharedRing`` a BATCH header names slots of (``locate`` / ``view``). Slots are never handed out
twice: ``acquire`` blocks while every slot is leased (back-pressure), and a duplicate release is an error.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import ClassVar

import torch

from dflash_pipe.wire.slots import PayloadSlot

log = logging.getLogger("dflash_pipe.wire.ring")


class RingUnavailable(RuntimeError):
    """This process cannot share the producer's ring (another host, pid namespace, user or GPU set, or no
    CUDA); the payloads take the next path (shared memory, then frames)."""


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class SlotRing:
    """``slots`` slots of ``slot_bytes`` in ``data`` (a uint8 tensor on the host or on one GPU).

    Subclasses set ``PATH`` (the payload path's name), call ``_init_slots`` and provide ``_private``
    (memory for a batch larger than a slot) and their own ``close`` (which calls ``_close_slots``)."""

    PATH: ClassVar[str]

    def _init_slots(self, data: torch.Tensor, slots: int, slot_bytes: int, *, owner: bool) -> None:
        self.slots, self.slot_bytes = slots, slot_bytes
        self.owner = owner
        self._data = data  # uint8 [slots * slot_bytes]
        self._base = data.data_ptr()
        self.device = data.device
        # the producer owns the slots; a worker only reads them
        self._free: deque[int] = deque(range(slots) if owner else ())
        self._cond = threading.Condition()
        self._closed = False

    # --- PayloadStaging -------------------------------------------------------------------------------------

    def _private(self, nbytes: int) -> torch.Tensor:
        """uint8 [nbytes] outside the ring, for a batch larger than a slot (it then travels as frames)."""
        raise NotImplementedError

    def acquire(self, nbytes: int, timeout_s: float | None = None) -> PayloadSlot:
        """A free slot (blocks while all are leased: back-pressure, never overwrite). A batch larger than a
        slot gets process-private memory instead, so it travels as frames."""
        if self._closed:
            raise RuntimeError(f"the {self.PATH} ring is closed")
        if nbytes > self.slot_bytes:
            log.warning(
                "a %d-byte batch does not fit a %d-byte %s ring slot; it goes as frames",
                nbytes,
                self.slot_bytes,
                self.PATH,
            )
            return PayloadSlot(buffer=self._private(nbytes), nbytes=nbytes)
        with self._cond:
            if not self._cond.wait_for(lambda: self._free or self._closed, timeout=timeout_s):
                raise TimeoutError(
                    f"every one of the {self.slots} {self.PATH} ring slots stayed leased for {timeout_s} s"
                )
            if self._closed:
                raise RuntimeError(f"the {self.PATH} ring was closed while waiting for a slot")
            slot = self._free.popleft()
        start = slot * self.slot_bytes
        return PayloadSlot(
            buffer=self._data[start : start + self.slot_bytes],
            nbytes=nbytes,
            slot_id=slot,
            _on_release=self._give_back,
        )

    def _give_back(self, slot: PayloadSlot) -> None:
        with self._cond:
            if slot.slot_id in self._free:
                raise RuntimeError(f"{self.PATH} ring slot {slot.slot_id} released twice")
            self._free.append(slot.slot_id)
            self._cond.notify()

    @property
    def leased(self) -> int:
        """Slots handed out and not yet released (producer side)."""
        with self._cond:
            return self.slots - len(self._free)

    # --- codec.SharedRing --------------------------------------------------------------------------------

    def locate(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        if self._closed or tensor.device != self.device or not tensor.is_contiguous():
            return None
        start = tensor.data_ptr() - self._base
        nbytes = tensor.numel() * tensor.element_size()
        if start < 0 or start >= self.slots * self.slot_bytes:
            return None
        slot, offset = divmod(start, self.slot_bytes)
        return (slot, offset) if offset + nbytes <= self.slot_bytes else None

    def view(self, slot: int, offset: int, nbytes: int) -> torch.Tensor:
        if self._closed:
            raise RuntimeError(f"the {self.PATH} ring is closed")
        start = slot * self.slot_bytes + offset
        return self._data[start : start + nbytes]

    # --- lifetime ----------------------------------------------------------------------------------------

    def _close_slots(self) -> bool:
        """Marks the ring closed and wakes every waiter; False if it already was."""
        with self._cond:
            if self._closed:
                return False
            self._closed = True
            self._cond.notify_all()
        return True
