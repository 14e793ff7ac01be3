"""The drafters' elastic data-parallel group: rendezvous per generation, step votes, sums of gradients.

Membership comes from torch.distributed.elastic's dynamic rendezvous (``DynamicRendezvousHandler`` on a
``C10dRendezvousBackend``), kept in the producer's TCPStore, used in-process without the elastic agent:
each *generation* of the group is one rendezvous round with its own process group. A worker that wants
in waits in the round's wait list; the members see it in their step vote and all move to the next round
at the same step boundary. A dead member makes a collective fail (gloo raises at once when the peer's
socket closes, or after the collective timeout), which we raise as ``GroupBrokenError``; the survivors
then move to the next round, where the rendezvous drops the dead node once its keep-alive expires.

Workers receive batches at different moments, so every step starts with a tiny vote: who has a batch,
who wants to stop, who leaves, whether someone waits to join, how many drafters each member runs and
whether the launch has started (``StepVote.may_step``: ``train.min_workers``). Gradients are summed (not
averaged) and divided by the global CE weight, so the update equals one big batch of all ranks' samples,
whatever the split or the world size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

_BUCKET_ELEMENTS = 32 * 1024 * 1024
_MAX_NODES = 4096
LAST_CALL_S = 1.0
"""After the first member of a round arrives, how long the rendezvous waits for the others."""
KEEP_ALIVE_S = 1
KEEP_ALIVE_MISSES = 3
"""A node whose rendezvous keep-alive is this many intervals old is dropped: about 3 s after a SIGKILL."""


class GroupBrokenError(RuntimeError):
    """A collective failed: a member died or vanished mid-step. Re-form the group and go on."""


class GpuTakenError(RuntimeError):
    """Another live worker of this run trains on this GPU: NCCL takes one rank per GPU, and a second one
    would break the group of every member."""


def claim_gpu(store: dist.Store, gpu: str, holder: str) -> None:
    """Takes ``gpu`` (a CUDA device's UUID) for ``holder`` in the run's store, or raises ``GpuTakenError``
    naming the live worker that has it. A claim whose process is gone (same machine, pid not running) is
    taken over, so a restarted worker gets its GPU back."""
    from dflash_pipe.wire.shm import host_identity

    key = f"gpu-claims/{gpu}"
    machine = host_identity(simulated=False)
    mine = f"{machine}|{os.getpid()}|{holder}"
    expected = ""
    for _ in range(8):  # another claimant may take it over between our read and our write
        current = store.compare_set(key, expected, mine).decode()
        if current == mine:
            return
        their_machine, pid, name = current.split("|", 2)
        if their_machine == machine and _alive(int(pid)):
            raise GpuTakenError(
                f"GPU {gpu} already trains in this run: worker {name} (pid {pid}) holds it, and NCCL takes one "
                "drafter per GPU (a second would break the whole group). Give this worker another GPU, or "
                f"stop {name} first."
            )
        expected = current  # its holder is gone: take it over
    raise GpuTakenError(f"GPU {gpu}: could not claim it in the run's store (claims keep changing)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RendezvousLostError(RuntimeError):
    """The rendezvous store (it lives in the producer) stopped answering: the producer is gone."""


@dataclass(slots=True)
class StepVote:
    active: int
    """How many ranks have a batch this step."""
    stop: bool
    """Someone wants the whole run to stop (DONE from the producer, max_steps)."""
    counts: list[int]
    """Per rank: how many sample ids it will share this step."""
    leaving: list[bool]
    """Per rank: it leaves the group after this vote (Ctrl-C on that worker)."""
    waiting: int
    """Workers waiting in the rendezvous to join."""
    drafters: int = 1
    """Drafters in the group: one per member process, more for a threaded member."""
    started: bool = True
    """Some member has seen this launch's first step allowed (or the run's store says so)."""

    @property
    def regroup(self) -> bool:
        return any(self.leaving) or self.waiting > 0

    def may_step(self, min_workers: int) -> bool:
        """Whether the group may take an optimizer step: once ``min_workers`` drafters are in, and from then
        on whatever the group's size (a member lost later must not freeze the run). Read from the vote
        alone, so every rank decides alike: one rank stepping while another waits would deadlock."""
        return self.started or self.drafters >= min_workers


class DrafterGroup:
    def __init__(
        self,
        rendezvous: str,
        *,
        run_id: str,
        device: torch.device,
        timeout_s: float,
        join_timeout_s: float,
        name: str = "",
    ) -> None:
        """``name``: the worker's, for the GPU claim another worker on the same GPU is refused with."""
        url = urlparse(rendezvous)
        if url.scheme != "tcp" or not url.hostname or not url.port:
            raise ValueError(f"Rendezvous address {rendezvous!r} must look like tcp://HOST:PORT.")
        # Rank 0 would otherwise start a second TCPStore server each round, for the elastic agent we do not run.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.rank = -1
        self.world_size = 0
        self.generation = 0
        """How many groups this worker has formed (1 = the first)."""
        self.started = False
        """This launch may step (``mark_started``): sticky for this process, shared through every vote."""
        self._timeout = timedelta(seconds=timeout_s)
        self._comm_device = device if self.backend == "nccl" else torch.device("cpu")
        store = dist.TCPStore(url.hostname, url.port, is_master=False, timeout=self._timeout)
        self._store = store
        self._started_key = f"drafters-{run_id}/started"
        if device.type == "cuda":
            claim_gpu(store, str(torch.cuda.get_device_properties(device).uuid), name or f"pid {os.getpid()}")
        self._handler: DynamicRendezvousHandler | None = DynamicRendezvousHandler.from_backend(
            run_id=f"drafters-{run_id}",
            store=store,
            backend=C10dRendezvousBackend(store, f"drafters-{run_id}"),
            min_nodes=1,
            max_nodes=_MAX_NODES,
            timeout=RendezvousTimeout(
                join=timedelta(seconds=join_timeout_s), last_call=timedelta(seconds=LAST_CALL_S)
            ),
            keep_alive_interval=KEEP_ALIVE_S,
            keep_alive_max_attempt=KEEP_ALIVE_MISSES,
        )

    def form(self) -> None:
        """Leaves the current process group (if any), joins the next rendezvous round, builds its group."""
        if dist.is_initialized():
            dist.destroy_process_group()
        with _rendezvous():
            info = self._handler.next_rendezvous()
        dist.init_process_group(
            self.backend,
            store=info.store,
            rank=info.rank,
            world_size=info.world_size,
            timeout=self._timeout,
            device_id=self.device if self.device.type == "cuda" else None,
        )
        self.rank, self.world_size = info.rank, info.world_size
        self.generation += 1

    def vote(self, *, has_batch: bool, stop: bool, leave: bool, num_ids: int, drafters: int = 1) -> StepVote:
        """``drafters``: how many this member trains (its replicas)."""
        with _rendezvous(store=True):
            waiting = self._handler.num_nodes_waiting()
            started = self.started or self._store.check([self._started_key])
        row = [int(has_batch), int(stop), num_ids, int(leave), waiting, drafters, int(started)]
        table = self.all_gather_ints(row)
        return StepVote(
            active=int(table[:, 0].sum()),
            stop=bool(table[:, 1].any()),
            counts=table[:, 2].tolist(),
            leaving=[bool(x) for x in table[:, 3].tolist()],
            waiting=int(table[:, 4].max()),
            drafters=int(table[:, 5].sum()),
            started=bool(table[:, 6].any()),
        )

    def mark_started(self) -> None:
        """This launch's first step is allowed: remembered here and in the run's store, so a member that
        joins later (even after every member that saw it is gone) never waits for ``min_workers`` again.
        The store lives in the producer: a new launch (``--resume``) starts with a new one."""
        if not self.started:
            self.started = True
            with _rendezvous(store=True):
                self._store.set(self._started_key, "1")

    def all_gather_ints(self, row: list[int]) -> torch.Tensor:
        """Every rank's row of small ints -> [world_size, len(row)] int64 on CPU."""
        mine = torch.tensor(row, dtype=torch.int64, device=self._comm_device)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        with _collective("vote"):
            dist.all_gather(everyone, mine)
        return torch.stack(everyone).cpu()

    def gather_ids(self, pairs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """pairs: [n, 2] int64 (epoch, sample id) of this rank -> [sum(counts), 2] of all ranks."""
        width = max(max(counts), 1)
        padded = torch.zeros(width, 2, dtype=torch.int64, device=self._comm_device)
        padded[: pairs.shape[0]] = pairs.to(self._comm_device)
        everyone = [torch.empty_like(padded) for _ in range(self.world_size)]
        with _collective("sample ids"):
            dist.all_gather(everyone, padded)
        return torch.cat([t[:n] for t, n in zip(everyone, counts, strict=True)]).cpu()

    def sum_vector(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over ranks of a small float64 vector (loss, weights, accuracy counts)."""
        t = values.to(self._comm_device)
        with _collective("totals"):
            dist.all_reduce(t)
        return t.cpu()

    def broadcast(self, tensors: list[torch.Tensor], src: int) -> None:
        """In place, from rank ``src`` to every rank (state handed to workers that join)."""
        with _collective("state hand-over"):
            for t in tensors:
                buf = t.to(self._comm_device)
                dist.broadcast(buf, src)
                if buf is not t:
                    t.copy_(buf)

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
        with _collective("gradients"):
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
        with _collective("barrier"):
            dist.barrier()

    def close(self) -> None:
        """Leaves the process group; dropping the handler stops its keep-alives, so the rendezvous
        drops this node within a few seconds (never ``shutdown()``: that closes the rendezvous for all)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self._handler = None


class _collective:
    """Turns a failed collective (a member died, or the collective timed out) into GroupBrokenError."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _tb: object) -> bool:
        if isinstance(exc, RuntimeError) and not isinstance(exc, GroupBrokenError):
            raise GroupBrokenError(
                f"{self.what} collective failed: {str(exc).splitlines()[0][:200]}"
            ) from exc
        return False


class _rendezvous:
    """Turns a lost connection to the rendezvous store into RendezvousLostError. ``store``: the block also
    calls the store itself (not through the rendezvous), whose errors are torch's ``DistError``s."""

    def __init__(self, *, store: bool = False) -> None:
        self.errors = (RendezvousConnectionError, dist.DistError) if store else (RendezvousConnectionError,)

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _tb: object) -> bool:
        if isinstance(exc, self.errors):
            raise RendezvousLostError(f"the drafters' rendezvous store stopped answering: {exc}") from exc
        return False
