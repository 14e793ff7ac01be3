"""The producer's core: plans, leases and accounting of one run, with no socket in it.

``ProducerCore`` admits workers (``producer.handshake``: HELLO -> WELCOME or REJECT), keeps the plan
queue of the target threads full, leases ready batches to workers with credits, takes ACKs, READYs,
METRICS and BYEs, drops silent or failed workers (their leases go back to the queue), and counts what the
summary and the dashboard show. It speaks through an ``Outbox`` (send a message, reject a peer), so a test
drives it with plain lists; ``ProducerProc`` (``producer.proc``) is the process shell with the socket,
the target threads and signals.

Its state lives in three components, each the only writer of its fields: ``peers`` (``producer.peers``:
who is in the run and what each said), ``leases`` (``producer.leasing``: the target threads' queues, the
scheduler's leases, regeneration's jobs, the eval set) and ``account`` (``producer.accounting``: the
step, rates, checkpoints and the dashboard's lines). The handlers here read them and call their
methods; what attaching producers add lives in ``producer.coordinator``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from dflash_pipe.diskspace import DiskFullError, human
from dflash_pipe.producer.accounting import Accounting
from dflash_pipe.producer.coordinator import (
    admit_producer,
    eval_plan,
    feature_bytes,
    lease_plans,
    send_plan,
    take_link_report,
)
from dflash_pipe.producer.display import log_worker_metrics
from dflash_pipe.producer.errors import RunAborted
from dflash_pipe.producer.handshake import admit
from dflash_pipe.producer.leasing import Leasing
from dflash_pipe.producer.min_workers import watch_group_wait
from dflash_pipe.producer.parts import Outbox
from dflash_pipe.producer.payloads import payload_for
from dflash_pipe.producer.peers import Peer, Peers
from dflash_pipe.producer.scheduler import PlannedBatch, ReadyBatch
from dflash_pipe.producer.setup import RunContext
from dflash_pipe.run.dir import RunDir
from dflash_pipe.telemetry import MetricsLogger
from dflash_pipe.wire import messages as m

if TYPE_CHECKING:
    from collections.abc import Iterator

    from dflash_pipe.producer.rings import Rings


class WorkerWatch(Protocol):
    """What the launcher tells the producer about the worker processes it started."""

    def newly_failed(self) -> list[tuple[str, str]]:
        """(worker name, what happened) for each launched worker that died since the last call."""
        ...

    def alive(self) -> int:
        """Launched workers still running (some may not have said HELLO yet)."""
        ...


class ProducerCore:
    """The state machine of one run: admission, routing and watching, over its three components."""

    def __init__(
        self,
        ctx: RunContext,
        *,
        out: Outbox,
        metrics: MetricsLogger,
        rings: Rings,
        host_id: str,
        rendezvous: str,
        warn: Any = None,
        plans: Iterator[PlannedBatch | None] | None = None,
    ) -> None:
        """``warn(line)``: where a lost worker is announced (the dashboard's console). ``plans``: plans
        made elsewhere (an attaching producer's, from the coordinator) instead of this run's own."""
        self.ctx, self.cfg = ctx, ctx.cfg
        self.out, self.rings = out, rings
        self.host_id, self.rendezvous = host_id, rendezvous
        self.account = Accounting(metrics=metrics, step=ctx.resume_step, warn=warn)
        self.peers = Peers()
        cfg = ctx.cfg
        self.leases = Leasing(
            ctx.train_samples,
            ctx.ledger,
            regen=ctx.regen,
            epochs=cfg.train.epochs,
            token_budget=cfg.data.token_budget,
            seed=cfg.train.seed,
            ready_batches=cfg.wire.ready_batches,
            note=self.account.note,
            plans=plans,
        )

    def note(self, text: str) -> None:
        self.account.note(text)

    def drop(self, peer: Peer, why: str) -> None:
        """A worker died or vanished: its leases go back to the queue, the others train on."""
        line = self.peers.mark_lost(peer, why)
        released = self.leases.release(peer.identity)
        self.account.log(
            {
                "workers_lost": float(len(self.peers.lost)),
                "released_samples": self.leases.scheduler.stats.released_samples,
            }
        )
        first = line.splitlines()[0]
        leased = "plan" if peer.role == "producer" else "batch"
        self.note(f"warning: {first}; {released} leased {leased}(es) go to the others")
        self.account.warn(f"[yellow]warning:[/] {first}; the run goes on without it")

    def drop_gone(self, peer_id: bytes, why: str) -> None:
        """A send found ``peer_id`` gone (its connection closed, or it stopped reading): dropped, unless it
        left already."""
        peer = self.peers.get(peer_id)
        if peer is not None and not peer.left:
            self.drop(peer, why)

    # --- inbound -----------------------------------------------------------------------------------------

    def handle(self, peer_id: bytes, msg: Any) -> None:
        peer = self.peers.get(peer_id)
        if peer is None or peer.left:
            if isinstance(msg, m.Hello):
                (admit_producer if msg.role == "producer" else admit)(self, peer_id, msg)
            elif not isinstance(msg, (m.Heartbeat, m.Bye, m.Error)):
                self.out.reject(peer_id, "say HELLO first")
            return
        self.peers.heard(peer)
        if isinstance(msg, m.Ready):
            if note := self.peers.ready(peer, msg):
                self.note(note)
        elif isinstance(msg, m.Ack):
            tokens = self.leases.ack(peer_id, msg.batch_ids)
            self.account.acked(msg.step, tokens, self.leases.scheduler.stats.acked_tokens)
            self.peers.stepped(peer, msg.step)
        elif isinstance(msg, m.Metrics):
            if msg.values.get("disk/low_space"):
                self._low_space(msg.values)
            if not take_link_report(self, peer, msg):
                log_worker_metrics(self, peer, msg)
        elif isinstance(msg, m.Checkpoint):
            self.account.checkpoint_arrived(msg.path, msg.step)
        elif isinstance(msg, m.Error):
            if msg.message.startswith(f"{DiskFullError.__name__}: "):  # every checkpoint would fail alike
                raise RunAborted(f"worker {peer.name}: {msg.message.split(': ', 1)[1]}")
            self.drop(peer, f"failed: {msg.message}\n{msg.traceback}")
        elif isinstance(msg, m.Bye):
            self.account.bye(msg.reason)
            self.peers.said_bye(peer)
            self.leases.release(peer_id)
        elif isinstance(msg, m.Serving):
            self._serving(peer, msg)
        elif isinstance(msg, m.Hello):
            self.out.send(peer_id, m.Reject(reason="already joined"))

    def _serving(self, peer: Peer, msg: m.Serving) -> None:
        """An attached producer says where its node's workers find it: workers of that node that say
        HELLO here are sent there from now on (``handshake.redirect_for``). Only a producer's word counts."""
        if peer.role != "producer":
            self.note(f"ignored SERVING from worker {peer.name}: only an attached producer serves workers")
            return
        if self.peers.serving(peer, msg.address):
            self.note(f"producer {peer.name} serves the workers of its node at {msg.address}")

    def _low_space(self, values: dict[str, Any]) -> None:
        free = human(float(values.get("disk/free_bytes", 0)))
        needed = human(float(values.get("disk/checkpoint_bytes", 0)))
        self.account.warn(
            f"[yellow]warning:[/] {RunDir(self.cfg.run_dir).checkpoints}: {free} free, a checkpoint takes {needed}: "
            "the next one may not fit; free space there or move the run dir to a larger disk"
        )

    # --- routing -----------------------------------------------------------------------------------------

    def take_ready(self) -> None:
        """What the target threads finished into the scheduler; the eval set, once computed, to every
        worker welcomed while it was pending (later ones get it with their WELCOME)."""
        batches = self.leases.take_ready()
        if batches is not None:
            self._send_eval(batches)

    def refill(self) -> None:
        """The target threads' queue kept full (``Leasing.refill``)."""
        self.leases.refill()

    def finished(self) -> bool:
        return self.leases.finished()

    def _send_eval(self, batches: list[m.Batch]) -> None:
        sent = 0
        for peer in self.peers.live():
            for batch in batches:
                if peer.left:
                    break
                if peer.role == "producer":  # computes the features on its own target
                    send_plan(self, peer, eval_plan(batch))
                else:
                    self.out.send(peer.identity, batch)
            sent += 1
        regen = self.leases.regen
        started = regen.started if regen is not None else None
        since = f", {time.monotonic() - started:.0f} s after the first generation job" if started else ""
        self.note(
            f"eval set ready: {sum(len(b.sample_ids) for b in batches)} held-out sample(s) in "
            f"{len(batches)} batch(es), sent to {sent} worker(s){since}"
        )

    def dispatch(self) -> None:
        """A leased batch to every worker holding a credit, while there are batches; a plan to every
        attaching producer holding one (``producer.coordinator``)."""
        if self.leases.done_sent:
            return
        lease_plans(self)
        for peer in self.peers.live():
            while peer.credits > 0 and not peer.left and peer.rank >= 0:
                batch = self.leases.lease_batch(peer.identity)
                if batch is None:
                    return
                self._send_batch(peer, batch)

    def _send_batch(self, peer: Peer, batch: ReadyBatch) -> None:
        """A BATCH by reference into the ring ``peer`` opened, else as a host copy (``payload_for``)."""
        ring = self.rings.cuda if peer.cuda_ipc else self.rings.shm if peer.shm else None
        payload = payload_for(batch, ring, self.rings.shm)
        self.out.send(peer.identity, payload, ring=ring)
        self.peers.spend_credit(peer, feature_bytes(payload))
        features = payload.tensors.get("features")
        by_ref = ring is not None and features is not None and ring.locate(features) is not None
        self.account.batch_sent(batch.tokens, ring.PATH if by_ref else None)

    def send_done(self, reason: str, *, evaluate: bool = True) -> None:
        """``evaluate`` False (a signal's drain): the workers checkpoint and leave without the final evaluation."""
        self.leases.mark_done()
        for peer in self.peers.live():
            self.out.send(peer.identity, m.Done(reason=reason, evaluate=evaluate))

    def request_checkpoint(self, why: str) -> None:
        """A preemption warning: every worker hears it; rank 0 checkpoints at its next step boundary and the
        run trains on. A step already checkpointed is not written again."""
        peers, step = self.peers.live(), self.account.step
        if not peers:
            self.account.warn(f"{why}: no worker has joined yet, so there is nothing to checkpoint")
            return
        if step == 0:  # workers write no checkpoint of the untrained initialisation
            self.account.warn(
                f"{why}: nothing is trained yet (step 0), so there is nothing to checkpoint; training goes on"
            )
            return
        for peer in peers:
            self.out.send(peer.identity, m.Checkpoint(step=step, path=""))
        self.account.checkpoint_asked(why)
        self.account.warn(f"{why}: checkpoint asked at step {step}; training goes on")

    # --- watching ----------------------------------------------------------------------------------------

    def check(self, watch: WorkerWatch | None) -> None:
        """Drops the workers the launcher saw die."""
        if watch is None:
            return
        for name, why in watch.newly_failed():
            peer = self.peers.named(name)
            if peer is not None:
                self.drop(peer, why)
            elif not any(p.name == name for p in self.peers.values()):  # died before its HELLO
                self.peers.lost_before_hello(name, why)
                self.note(f"warning: {name} {why.splitlines()[0]}")

    def watch_peers(self) -> None:
        """Heartbeats every ``heartbeat_s``; drops a worker silent for ``peer_timeout_s``; a group that
        waits for ``train.min_workers`` too long stops the run (``producer.min_workers``)."""
        now = time.monotonic()
        watch_group_wait(self, coordinator=not self.ctx.attached, now=now)
        if self.peers.beat_due(now, self.cfg.wire.heartbeat_s):
            for peer in self.peers.live():
                self.out.send(peer.identity, m.Heartbeat(time=time.time()))
        for peer in self.peers.live():
            silent = now - peer.last_heard
            if not peer.left and silent > self.cfg.wire.peer_timeout_s:
                self.drop(
                    peer,
                    f"has been silent for {silent:.0f} s (wire.peer_timeout_s = "
                    f"{self.cfg.wire.peer_timeout_s:.0f}); it is probably dead or hung",
                )

    def observe_waits(self) -> None:
        leases = self.leases
        if leases.done_sent:
            return
        active = [p for p in self.peers.live() if p.state == "training"]
        idle = max(0, leases.target_threads - leases.in_target)
        self.account.observe_waits(
            target_idle=idle / max(leases.target_threads, 1),
            workers_starved=sum(p.credits > 0 for p in active) / max(len(active), 1),
            queue_depth=leases.scheduler.ready_count(),
        )
