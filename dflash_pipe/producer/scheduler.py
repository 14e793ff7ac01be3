"""Which batch goes where: epoch plans, leases until ACK, redelivery after a worker is lost.

Two kinds of lease end in the same ACK: a computed batch leased to a worker, and a bare plan leased to an
attaching producer (``lease_plan``), which computes it on its own node. A lost worker's batches go back to
the ready queue; a lost producer's plans go back to the plans, for any replica to compute again.

Pure bookkeeping (no sockets, no tensors) so the rules that guarantee "no sample lost, none trained twice
in an epoch" are testable on their own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

PlanFn = Callable[[int, set[int]], Iterable[list[int] | None]]
"""(epoch, sample ids to exclude) -> that epoch's batches as lists of sample ids. An iterator may yield
None for "nothing to plan yet, ask again" (epoch 0 while the target still regenerates the data)."""


_END = object()


@dataclass(slots=True)
class PlannedBatch:
    batch_id: int
    epoch: int
    sample_ids: list[int]


@dataclass(slots=True)
class ReadyBatch:
    """A planned batch whose features exist; ``payload`` is the encoded message the wire sends."""

    plan: PlannedBatch
    payload: Any
    tokens: int
    slot: Any = None
    """The ``PayloadSlot`` the payload's bytes live in, if any: released when the batch is ACKed."""
    host_payload: Any = None
    """A host copy of a payload staged in GPU memory, made for a worker that cannot open the GPU ring."""
    host_slot: Any = None
    """The ``PayloadSlot`` of that copy: released with ``slot``."""

    def release(self) -> None:
        """Gives back the staging memory (on the ACK; never while a lost worker's copy may be redelivered)."""
        for slot in (self.slot, self.host_slot):
            if slot is not None:
                slot.release()


@dataclass(slots=True)
class Lease:
    worker: bytes
    batch: ReadyBatch
    sent_at: float
    plan_only: bool = False
    """A bare plan leased to an attaching producer (no features here): released, it is planned again."""


@dataclass(slots=True)
class SchedulerStats:
    planned: int = 0
    sent: int = 0
    acked: int = 0
    redelivered: int = 0
    released_samples: int = 0
    """Samples in batches taken back from lost or leaving workers: the most that can be trained twice."""
    unknown_acks: int = 0
    acked_tokens: int = 0
    acked_samples: int = 0


@dataclass(slots=True)
class BatchScheduler:
    plan_epoch: PlanFn
    epochs: int
    start_epoch: int = 0
    trained_in_start_epoch: set[int] = field(default_factory=set)
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    source: Iterator[PlannedBatch | None] | None = None
    """Plans made elsewhere (an attaching producer's: the coordinator's PLANs) instead of ``plan_epoch``'s.
    Yields None while none is waiting; its end is the end of the plan."""
    _plans: Iterator[PlannedBatch | None] | None = None
    _replan: deque[PlannedBatch] = field(default_factory=deque)
    _ready: deque[ReadyBatch] = field(default_factory=deque)
    _leases: dict[int, Lease] = field(default_factory=dict)
    _outstanding: int = 0
    _exhausted: bool = False

    def __post_init__(self) -> None:
        self._plans = self.source if self.source is not None else self._generate()

    def _generate(self) -> Iterator[PlannedBatch | None]:
        batch_id = 0
        for epoch in range(self.start_epoch, self.epochs):
            exclude = self.trained_in_start_epoch if epoch == self.start_epoch else set()
            for ids in self.plan_epoch(epoch, exclude):
                if ids is None:
                    yield None  # not plannable yet
                    continue
                yield PlannedBatch(batch_id=batch_id, epoch=epoch, sample_ids=ids)
                batch_id += 1

    def next_plan(self) -> PlannedBatch | None:
        """The next batch the target should compute; None once every epoch is planned (``finished`` can
        then become true) or while the plan waits for samples that do not exist yet."""
        if self._replan:  # a lost producer's: still outstanding, planned once
            return self._replan.popleft()
        if self._exhausted:
            return None
        plan = next(self._plans, _END)  # type: ignore[arg-type]
        if plan is None:
            return None
        if plan is _END:
            self._exhausted = True
            return None
        self.stats.planned += 1
        self._outstanding += 1
        return plan

    def add_ready(self, batch: ReadyBatch) -> None:
        self._ready.append(batch)

    def ready_count(self) -> int:
        return len(self._ready)

    def leased_count(self) -> int:
        return len(self._leases)

    def lease_next(self, worker: bytes, now: float) -> ReadyBatch | None:
        if not self._ready:
            return None
        batch = self._ready.popleft()
        self._leases[batch.plan.batch_id] = Lease(worker=worker, batch=batch, sent_at=now)
        self.stats.sent += 1
        return batch

    def lease_plan(self, producer: bytes, plan: PlannedBatch, tokens: int, now: float) -> None:
        """``plan`` goes to an attaching producer: it stays outstanding until that producer forwards its ACK,
        and goes back to the plans if the producer is lost (``release``)."""
        self._leases[plan.batch_id] = Lease(
            worker=producer,
            batch=ReadyBatch(plan=plan, payload=None, tokens=tokens),
            sent_at=now,
            plan_only=True,
        )
        self.stats.sent += 1

    def ack(self, worker: bytes, batch_ids: Sequence[int]) -> None:
        for batch_id in batch_ids:
            lease = self._leases.get(batch_id)
            if lease is None or lease.worker != worker:
                self.stats.unknown_acks += 1
                continue
            del self._leases[batch_id]
            lease.batch.release()
            self._outstanding -= 1
            self.stats.acked += 1
            self.stats.acked_tokens += lease.batch.tokens
            self.stats.acked_samples += len(lease.batch.plan.sample_ids)

    def release(self, worker: bytes) -> int:
        """A worker is gone: its leased batches go back to the front of the queue, in order (a producer's
        leased plans to the front of the plans)."""
        lost = sorted((bid for bid, lease in self._leases.items() if lease.worker == worker), reverse=True)
        for batch_id in lost:
            lease = self._leases.pop(batch_id)
            self.stats.released_samples += len(lease.batch.plan.sample_ids)
            if lease.plan_only:
                self._replan.appendleft(lease.batch.plan)
            else:
                self._ready.appendleft(lease.batch)
        self.stats.redelivered += len(lost)
        return len(lost)

    def finished(self) -> bool:
        """Every epoch planned and every planned batch acknowledged."""
        return self._exhausted and self._outstanding == 0 and not self._replan
