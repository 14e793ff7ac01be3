"""The drafters' data-parallel group: agreeing on each step, sharing sample ids, summing gradients.

Workers receive batches at different moments, so every step starts with a tiny collective vote: who has a
batch, and does anyone want to stop. A rank without a batch still joins the gradient sum with zeros.
Gradients are summed (not averaged) and divided by the global CE weight, so the update equals one big
batch of all ranks' samples, whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

_BUCKET_ELEMENTS = 32 * 1024 * 1024


@dataclass(slots=True)
class StepVote:
    active: int
    """How many ranks have a batch this step."""
    stop: bool
    counts: list[int]
    """Per rank: how many sample ids it will share this step."""


class DrafterGroup:
    def __init__(
        self, rendezvous: str, *, rank: int, world_size: int, device: torch.device, timeout_s: float
    ):
        url = urlparse(rendezvous)
        if url.scheme != "tcp" or not url.hostname or not url.port:
            raise ValueError(f"Rendezvous address {rendezvous!r} must look like tcp://HOST:PORT.")
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(url.hostname, url.port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore("drafters", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
        self._comm_device = device if self.backend == "nccl" else torch.device("cpu")

    def vote(self, *, has_batch: bool, stop: bool, num_ids: int) -> StepVote:
        mine = torch.tensor([int(has_batch), int(stop), num_ids], dtype=torch.int64, device=self._comm_device)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine)
        table = torch.stack(everyone).cpu()
        return StepVote(
            active=int(table[:, 0].sum()), stop=bool(table[:, 1].any()), counts=table[:, 2].tolist()
        )

    def gather_ids(self, pairs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """pairs: [n, 2] int64 (epoch, sample id) of this rank -> [sum(counts), 2] of all ranks."""
        width = max(max(counts), 1)
        padded = torch.zeros(width, 2, dtype=torch.int64, device=self._comm_device)
        padded[: pairs.shape[0]] = pairs.to(self._comm_device)
        everyone = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(everyone, padded)
        return torch.cat([t[:n] for t, n in zip(everyone, counts, strict=True)]).cpu()

    def sum_scalar(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t)
        return float(t.item())

    def sum_vector(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over ranks of a small float64 vector (loss, weights, accuracy counts)."""
        t = values.to(self._comm_device)
        dist.all_reduce(t)
        return t.cpu()

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """In-place sum of every rank's gradients, in flat buckets (missing grads count as zeros)."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.world_size == 1:
            return
        buckets: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for p in params:
            if size + p.numel() > _BUCKET_ELEMENTS and buckets[-1]:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += p.numel()
        pending = []
        for bucket in buckets:
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            pending.append((bucket, flat, dist.all_reduce(flat, async_op=True)))
        for bucket, flat, work in pending:
            work.wait()
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
