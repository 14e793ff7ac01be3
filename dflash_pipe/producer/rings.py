"""The producer's payload rings: how big they are and which are made (``core.choose_offers`` says which a
joining worker is offered).

A ring's slot holds the largest possible batch (fp8 or the target's dtype, plus one fp32 scale per token and
target layer); there are enough slots for the batches computed ahead, those in the target threads and
every launched drafter's credits, so the ring rarely applies back-pressure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash_pipe.data import sample_lengths
from dflash_pipe.producer.errors import RunAborted
from dflash_pipe.producer.setup import RunContext
from dflash_pipe.wire.cuda_ipc import CudaIpcRing
from dflash_pipe.wire.ring import RingUnavailable
from dflash_pipe.wire.shm import ShmRing
from dflash_pipe.wire.slots import PayloadStaging, PrivateStaging


@dataclass(slots=True)
class Rings:
    """The rings this producer holds (None: not made), and the staging the target threads copy into."""

    cuda: CudaIpcRing | None
    shm: ShmRing | None

    @property
    def staging(self) -> PayloadStaging:
        """The CUDA IPC ring when there is one, else the shared-memory ring (same-host workers read the
        slots directly), else private pinned buffers."""
        return self.cuda or self.shm or PrivateStaging()

    def close(self) -> None:
        for ring in (self.shm, self.cuda):
            if ring is not None:
                ring.close()


def ring_shape(ctx: RunContext) -> tuple[int, int]:
    """(slots, slot bytes) of a payload ring for this run."""
    cfg, wire = ctx.cfg, ctx.cfg.wire
    longest = (
        cfg.data.max_length  # regenerated or leased samples: not known yet, at most max_length
        if ctx.regen is not None or ctx.attached
        else int(sample_lengths(ctx.train_samples).max())
    )
    tokens = max(cfg.data.token_budget, longest)
    k, width = len(ctx.drafter.target_layer_ids), ctx.drafter.feature_size
    per_token = width * (1 if wire.wire_dtype == "fp8" else ctx.target_dtype.itemsize) + 4 * k
    replicas = max(1, len(cfg.layout.target_devices()))
    drafters = max(1, len(cfg.layout.worker_devices()))  # threaded mode: one process, many drafters
    slots = wire.ready_batches + 2 * replicas + wire.worker_credits * drafters + 1
    return slots, tokens * per_token + 4096


def make_rings(ctx: RunContext, note: Callable[[str], None]) -> Rings:
    """The rings ``wire.payload_path`` asks for, each of one shape (``ring_shape``); ``note`` hears why an
    optional one is missing, and a ring the path demands but cannot be made is ``RunAborted``."""
    path = ctx.cfg.wire.payload_path
    if path not in ("auto", "shm", "cuda_ipc"):
        return Rings(cuda=None, shm=None)
    shape = ring_shape(ctx)
    device = torch.device(ctx.cfg.layout.target_devices()[0])
    return Rings(cuda=_make_cuda_ring(path, shape, device, note), shm=_make_shm_ring(path, shape, note))


def _make_shm_ring(path: str, shape: tuple[int, int], note: Callable[[str], None]) -> ShmRing | None:
    """The shared-memory ring same-host workers read payloads from (with payload_path auto or shm)."""
    if path not in ("auto", "shm"):
        return None
    try:
        return ShmRing.create(*shape)
    except (RingUnavailable, OSError) as exc:
        if path == "shm":
            raise RunAborted(f"wire.payload_path is shm, but no shared-memory ring: {exc}") from exc
        note(f"shared-memory ring unavailable ({exc}); payloads go as frames")
        return None


def _make_cuda_ring(
    path: str, shape: tuple[int, int], device: torch.device, note: Callable[[str], None]
) -> CudaIpcRing | None:
    """The ring in the (first) target GPU's memory, ``device``, that same-host CUDA workers open with CUDA
    IPC (with payload_path auto or cuda_ipc, when the target runs on CUDA). Target replicas on other GPUs
    copy into it peer to peer."""
    if path not in ("auto", "cuda_ipc"):
        return None
    try:
        if device.type != "cuda":
            raise RingUnavailable(f"the target runs on {device}, not on a GPU")
        return CudaIpcRing.create(*shape, device)
    except (RingUnavailable, RuntimeError) as exc:
        if path == "cuda_ipc":
            raise RunAborted(f"wire.payload_path is cuda_ipc, but no CUDA IPC ring: {exc}") from exc
        if device.type == "cuda":
            note(f"CUDA IPC ring unavailable ({exc}); same-host payloads use shared memory")
        return None
