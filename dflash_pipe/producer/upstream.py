"""An attaching producer's link to the run's coordinator: plans in, its workers' ACKs and metrics out.

The attaching producer is a ``ProducerProc`` whose plans come from here instead of its own planner
(``BatchScheduler(source=...)``): the coordinator's PLANs carry the samples' tokens, which
``LeasedSamples`` holds until their batch is ACKed. Each loop turn ``pump`` takes what the coordinator sent,
asks for as many plans as its replicas and ready queue can take (READY credits, as a worker asks for
batches), sends heartbeats and notices a silent coordinator. Once its replicas are loaded (its loop
answers HELLOs from then on) it tells the coordinator where it serves its node's workers (SERVING), so
the coordinator sends the workers of this node that say HELLO there to it instead. Its workers' ACKs, METRICS and CHECKPOINTs
go up unchanged (``forward``): the coordinator ends the plans' leases and keeps the run's record.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from dflash_pipe.data import Sample
from dflash_pipe.producer.coordinator import own_link_bytes
from dflash_pipe.producer.scheduler import PlannedBatch
from dflash_pipe.wire import messages as m
from dflash_pipe.wire.errors import ProtocolError, TransportError
from dflash_pipe.wire.transport import WorkerEndpoint

if TYPE_CHECKING:
    from dflash_pipe.producer.core import ProducerCore


REPORT_EVERY_S = 5.0
"""How often an attaching producer logs its links' bytes and tokens/s and reports them to the coordinator."""


class CoordinatorLost(RuntimeError):
    """The coordinator refused this producer, stopped answering, or failed."""


class LeasedSamples:
    """The samples of the plans this producer holds, by sample id (what the target threads read), each
    kept until the last batch holding it is ACKed. ``len`` is the run's sample count (the workers' ledger)."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples
        self._held: dict[int, tuple[Sample, int]] = {}

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, sample_id: int) -> Sample:
        return self._held[sample_id][0]

    def hold(self, samples: list[Sample]) -> None:
        for s in samples:
            _, count = self._held.get(s.sample_id, (s, 0))
            self._held[s.sample_id] = (s, count + 1)

    def drop(self, sample_ids: list[int]) -> None:
        for i in sample_ids:
            sample, count = self._held.pop(i, (None, 0))
            if count > 1:
                self._held[i] = (sample, count - 1)  # type: ignore[assignment]

    def held(self) -> int:
        return len(self._held)


def plan_samples(plan: m.Plan) -> list[Sample]:
    """The PLAN's packed tokens as one ``Sample`` each (copies: the message's tensors share its buffer)."""
    ids = plan.tensors["input_ids"].to(torch.int64).split(plan.lengths)
    mask = plan.tensors["loss_mask"].to(torch.bool).split(plan.lengths)
    return [
        Sample(sample_id=i, input_ids=a.clone(), loss_mask=b.clone())
        for i, a, b in zip(plan.sample_ids, ids, mask, strict=True)
    ]


class Upstream:
    def __init__(self, endpoint: WorkerEndpoint, welcome: m.Welcome, *, name: str) -> None:
        self.endpoint = endpoint
        self.name = name
        self.address = endpoint.address
        self.welcome = welcome
        self.samples = LeasedSamples(welcome.num_samples)
        self.heartbeat_s, self.peer_timeout_s = welcome.heartbeat_s, welcome.peer_timeout_s
        self._plans: deque[PlannedBatch] = deque()
        self._batch_samples: dict[int, list[int]] = {}
        self._eval: list[m.Plan] = []
        self.requested = 0
        """Plans asked for (READY credits) and not come yet."""
        self.ended = False
        """The coordinator said DONE: no plan comes any more."""
        self.plans_received = 0
        self.serves = ""
        """This producer's address for the workers of its node (``serve_at``, once bound)."""
        self.announced = False
        """SERVING went up: the coordinator redirects this node's workers here."""
        self._last_heard = self._last_sent = self._last_report = time.monotonic()

    def serve_at(self, address: str) -> None:
        """Where this producer serves its node's workers: said to the coordinator (SERVING) once a replica
        of the target is loaded, so a worker sent here is answered at once."""
        self.serves = address

    def source(self) -> Iterator[PlannedBatch | None]:
        """The plans as they come (None while none waits), ending with the coordinator's DONE."""
        while True:
            if self._plans:
                yield self._plans.popleft()
            elif self.ended:
                return
            else:
                yield None

    def pump(self, core: ProducerCore) -> None:
        """One loop turn: what the coordinator sent, then as many plans asked for as ``core`` can take."""
        while (msg := self._recv()) is not None:
            self._last_heard = time.monotonic()
            self._handle(core, msg)
        now = time.monotonic()
        if now - self._last_heard > self.peer_timeout_s:
            raise CoordinatorLost(
                f"the coordinator at {self.address} has been silent for {now - self._last_heard:.0f} s "
                f"(--peer-timeout {self.peer_timeout_s:.0f}); it probably died"
            )
        if self.serves and not self.announced and core.leases.target_threads > 0:
            self._send(m.Serving(address=self.serves))
            self.announced = True
        if now - self._last_report >= REPORT_EVERY_S:
            self._last_report = now
            values = own_link_bytes(core)
            core.account.log(values)
            self._send(m.Metrics(step=core.account.step, values=values))
        wanted = self.wanted(core)
        if wanted > 0:
            self._send(m.Ready(credits=wanted))
            self.requested += wanted
        elif now - self._last_sent >= self.heartbeat_s:
            self._send(m.Heartbeat(time=time.time()))

    def wanted(self, core: ProducerCore) -> int:
        """Plans to ask for: enough to keep ``wire.ready_batches`` computed and two plans per replica in
        computation, counting those already here or asked for."""
        if self.ended or core.leases.done_sent or core.leases.target_threads == 0:  # no replica loaded yet
            return 0
        bound = core.cfg.wire.ready_batches + 2 * core.leases.target_threads
        have = core.leases.in_target + core.leases.scheduler.ready_count() + len(self._plans) + self.requested
        return bound - have

    def forward(self, msg: Any) -> None:
        """A worker's ACK, METRICS or CHECKPOINT, up to the coordinator; the ACKed plans' samples are let go."""
        if isinstance(msg, m.Ack):
            for batch_id in msg.batch_ids:
                self.samples.drop(self._batch_samples.pop(batch_id, []))
        self._send(msg)

    def leave(self, core: ProducerCore, reason: str) -> None:
        """The last report and BYE to the coordinator (its open plans go back to the others), then close.
        Never raises: the coordinator may be gone already."""
        values = own_link_bytes(core)
        core.account.log(values)
        with contextlib.suppress(CoordinatorLost):
            self._send(m.Metrics(step=core.account.step, values=values))
        self.endpoint.send_final(m.Bye(reason=reason))

    def _handle(self, core: ProducerCore, msg: Any) -> None:
        if isinstance(msg, m.Plan):
            if msg.eval_set:
                self._take_eval(core, msg)
                return
            self.samples.hold(plan_samples(msg))
            self._batch_samples[msg.batch_id] = list(msg.sample_ids)
            self._plans.append(
                PlannedBatch(batch_id=msg.batch_id, epoch=msg.epoch, sample_ids=msg.sample_ids)
            )
            self.requested = max(0, self.requested - 1)
            self.plans_received += 1
        elif isinstance(msg, m.Done):
            self.ended = True
            core.send_done(msg.reason, evaluate=msg.evaluate)
        elif isinstance(msg, m.Checkpoint):
            core.request_checkpoint("the coordinator asked for a checkpoint")
        elif isinstance(msg, m.Reject):
            raise CoordinatorLost(f"the coordinator at {self.address} refused this producer: {msg.reason}")
        elif isinstance(msg, m.Error):
            raise CoordinatorLost(f"the coordinator at {self.address} failed: {msg.message}")

    def _take_eval(self, core: ProducerCore, plan: m.Plan) -> None:
        """The held-out set's PLANs; once all are here, one target thread turns them into eval BATCHes."""
        self._eval.append(plan)
        if len(self._eval) == plan.eval_set:
            samples = [s for p in self._eval for s in plan_samples(p)]
            core.leases.queue_eval(samples)

    def _recv(self) -> Any:
        try:
            return self.endpoint.recv(timeout_s=0.0)
        except (TransportError, ProtocolError) as exc:  # refused keys, a malformed message
            raise CoordinatorLost(f"the link to the coordinator at {self.address} failed: {exc}") from exc

    def _send(self, msg: Any) -> None:
        try:
            self.endpoint.send(msg)
        except TransportError as exc:
            raise CoordinatorLost(f"the coordinator at {self.address} stopped reading: {exc}") from exc
        self._last_sent = time.monotonic()
