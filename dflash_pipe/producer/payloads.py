"""What one worker is sent for a batch: the staged BATCH as is, or a host copy of GPU-staged features.

With the CUDA IPC ring as the staging (``wire.cuda_ipc``), a batch's features live in GPU memory. A worker
that opened that ring gets the slot by reference. Any other worker (shared memory, frames, or a batch too
big for a slot) needs the bytes on the host: the first such send copies the GPU tensors once, into a
shared-memory ring slot when that worker maps the ring and one is free at once, else into private pinned
memory. The copy stays with the batch (``ReadyBatch.host_payload``) and is released with it on the ACK, so
a redelivery reuses it.
"""

from __future__ import annotations

import msgspec
import torch

from dflash_pipe.producer.scheduler import ReadyBatch
from dflash_pipe.wire import messages as m
from dflash_pipe.wire.codec import SharedRing
from dflash_pipe.wire.ring import SlotRing
from dflash_pipe.wire.slots import PayloadSlot, slot_layout


def payload_for(batch: ReadyBatch, ring: SharedRing | None, shm: SlotRing | None = None) -> m.Batch:
    """The message for a worker that reads ``ring`` (None: frames only).

    Device tensors ``ring`` cannot name are copied to the host (synchronously: the batch is complete, its
    copy into the GPU slot was waited for); ``shm``: the shared-memory ring to copy into when ``ring`` is
    it."""
    msg = batch.payload
    stranded = [
        name
        for name, t in msg.tensors.items()
        if t.device.type != "cpu" and (ring is None or ring.locate(t) is None)
    ]
    if not stranded:
        return msg
    if batch.host_payload is None:
        batch.host_payload, batch.host_slot = _host_copy(msg, stranded, shm if ring is shm else None)
    return batch.host_payload


def _host_copy(msg: m.Batch, names: list[str], shm: SlotRing | None) -> tuple[m.Batch, PayloadSlot]:
    stranded = {name: msg.tensors[name] for name in names}
    offsets, nbytes = slot_layout(stranded)
    slot = None
    if shm is not None:
        try:
            slot = shm.acquire(nbytes, timeout_s=0.0)  # the main thread never waits for a slot
        except TimeoutError:
            slot = None
    if slot is None:
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        slot = PayloadSlot(buffer=buffer, nbytes=nbytes)
    copies = slot.views(stranded, offsets)
    for name, t in stranded.items():
        copies[name].copy_(t)
    return msgspec.structs.replace(msg, tensors={**msg.tensors, **copies}), slot
