"""The producer's core: plans, leases and accounting of one run, with no socket in it.

``ProducerCore`` admits workers (``producer.handshake``: HELLO -> WELCOME or REJECT), keeps the plan
queue of the target threads full, leases ready batches to workers with credits, takes ACKs, READYs,
METRICS and BYEs, drops silent or failed workers (their leases go back to the queue), and counts what the
summary and the dashboard show. It speaks through an ``Outbox`` (send a message, reject a peer), so a test
drives it with plain lists; ``ProducerProc`` (``producer.proc``) is the process shell with the socket,
the target threads and signals.

What it keeps (peers, queues, counters) is ``CoreState`` (``producer.state``), which the steps in their
own modules (``handshake``, ``coordinator``, ``display``) read; what attaching producers add lives in
``producer.coordinator``.
"""

from __future__ import annotations

import queue
import time
from typing import Any, Protocol

from dflash_pipe.diskspace import DiskFullError, human
from dflash_pipe.producer.coordinator import (
    admit_producer,
    count_features,
    eval_plan,
    lease_plans,
    send_plan,
    take_link_report,
)
from dflash_pipe.producer.display import log_worker_metrics
from dflash_pipe.producer.errors import NothingToTrain, RunAborted
from dflash_pipe.producer.handshake import admit
from dflash_pipe.producer.min_workers import watch_group_wait
from dflash_pipe.producer.payloads import payload_for
from dflash_pipe.producer.regen import GenerateDone
from dflash_pipe.producer.scheduler import ReadyBatch
from dflash_pipe.producer.state import CoreState, Peer
from dflash_pipe.producer.target_threads import EvalDone, EvalJob, TargetFailure
from dflash_pipe.run.dir import RunDir
from dflash_pipe.wire import messages as m


class WorkerWatch(Protocol):
    """What the launcher tells the producer about the worker processes it started."""

    def newly_failed(self) -> list[tuple[str, str]]:
        """(worker name, what happened) for each launched worker that died since the last call."""
        ...

    def alive(self) -> int:
        """Launched workers still running (some may not have said HELLO yet)."""
        ...


class ProducerCore(CoreState):
    """The state machine of one run: admission, routing and watching, over the state ``CoreState`` holds."""

    # --- inbound -----------------------------------------------------------------------------------------

    def handle(self, peer_id: bytes, msg: Any) -> None:
        peer = self.peers.get(peer_id)
        if peer is None or peer.left:
            if isinstance(msg, m.Hello):
                (admit_producer if msg.role == "producer" else admit)(self, peer_id, msg)
            elif not isinstance(msg, (m.Heartbeat, m.Bye, m.Error)):
                self.out.reject(peer_id, "say HELLO first")
            return
        peer.last_heard = time.monotonic()
        if isinstance(msg, m.Ready):
            if peer.state == "starting":  # the first READY says which ring the worker could open
                self._ready_paths(peer, msg)
            peer.credits += msg.credits
            peer.state = "training"
        elif isinstance(msg, m.Ack):
            self._ack(peer, msg)
        elif isinstance(msg, m.Metrics):
            if msg.values.get("disk/low_space"):
                self._low_space(msg.values)
            if not take_link_report(self, peer, msg):
                log_worker_metrics(self, peer, msg)
        elif isinstance(msg, m.Checkpoint):
            self.last_checkpoint, self.last_checkpoint_at = msg.path, time.monotonic()
            if self.save_asked is not None:
                self.warn(f"checkpoint written at step {msg.step} ({self.save_asked}): {msg.path}")
                self.save_asked = None
        elif isinstance(msg, m.Error):
            if msg.message.startswith(f"{DiskFullError.__name__}: "):  # every checkpoint would fail alike
                raise RunAborted(f"worker {peer.name}: {msg.message.split(': ', 1)[1]}")
            self.drop(peer, f"failed: {msg.message}\n{msg.traceback}")
        elif isinstance(msg, m.Bye):
            self.bye_reason = self.bye_reason or msg.reason
            peer.left = True
            peer.state = "left"
            self.scheduler.release(peer_id)
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
        if peer.serves != msg.address:
            peer.serves = msg.address
            self.note(f"producer {peer.name} serves the workers of its node at {msg.address}")

    def _ack(self, peer: Peer, msg: m.Ack) -> None:
        tokens_before = self.scheduler.stats.acked_tokens
        self.scheduler.ack(peer.identity, msg.batch_ids)
        if self.first_ack is None:
            self.first_ack = (time.monotonic(), self.scheduler.stats.acked_tokens)
        now, acked, produced = time.monotonic(), self.scheduler.stats.acked_tokens, self.target_rate.total
        if self.window_start is None or self.window_start[0] == msg.step:
            self.window_start = (msg.step, now, acked, produced)
        self.last_ack = (now, acked, produced)
        self.train_rate.add(self.scheduler.stats.acked_tokens - tokens_before)
        peer.steps = msg.step
        self.step = max(self.step, msg.step)

    def _ready_paths(self, peer: Peer, msg: m.Ready) -> None:
        peer.cuda_ipc = msg.cuda_ipc and peer.cuda_offered
        peer.shm = msg.shm and peer.ring_offered and not peer.cuda_ipc
        if peer.cuda_offered and not peer.cuda_ipc:
            fallback = "shared memory" if peer.shm else "frames"
            self.note(
                f"warning: {peer.name} could not open the CUDA IPC ring (see its log); its payloads go "
                f"through {fallback}"
            )

    def _low_space(self, values: dict[str, Any]) -> None:
        free = human(float(values.get("disk/free_bytes", 0)))
        needed = human(float(values.get("disk/checkpoint_bytes", 0)))
        self.warn(
            f"[yellow]warning:[/] {RunDir(self.cfg.run_dir).checkpoints}: {free} free, a checkpoint takes {needed}: "
            "the next one may not fit; free space there or move the run dir to a larger disk"
        )

    # --- routing -----------------------------------------------------------------------------------------

    def take_ready(self) -> None:
        """Moves what the target threads finished into the scheduler (regenerated replies to ``regen``, the
        eval set to the workers). The replies that came meanwhile are written together (one flush)."""
        replies: list[GenerateDone] = []
        while True:
            try:
                item = self.ready.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, TargetFailure):
                raise RunAborted(f"target replica {item.replica} failed: {item.error!r}") from item.error
            if isinstance(item, EvalDone):
                self._install_eval(item)
                continue
            if isinstance(item, GenerateDone):
                self.generating -= int(item.last)
                replies.append(item)
                continue
            self.in_target -= 1
            self.scheduler.add_ready(item)
        if replies and (note := self.regen.accept(*replies)):  # type: ignore[union-attr]
            self.note(note)
        if self.regen is not None and (why := self.regen.nothing_to_train()):  # also a reused file's
            raise NothingToTrain(why)

    def refill(self) -> None:
        """Keeps ``ready_batches`` computed plus two plans per target thread in computation, so no replica
        waits on us: all threads take from one queue (an idle one takes the next plan), and each holds one
        batch whose copy drains while it computes the next (``TargetThread``)."""
        bound = self.cfg.wire.ready_batches + 2 * self.target_threads
        while self.in_target + self.scheduler.ready_count() < bound:
            if self.done_sent:
                return
            plan = self.scheduler.next_plan()
            if plan is None:
                break
            self.plans.put(plan)
            self.in_target += 1
        self._refill_generation()
        self._refill_eval()

    def _refill_eval(self) -> None:
        """Once every held-out conversation is regenerated, its samples go to a target thread to become the
        eval BATCHes (an ``EvalJob``): the main thread never runs a forward itself."""
        if not self.eval_pending or self._eval_queued or self.regen is None or not self.regen.eval_ready:
            return
        self._eval_queued = True
        samples = self.regen.eval_samples()
        if not samples:
            self.eval_pending = False
            if len(self.regen.eval_indexes):
                self.note("warning: no held-out conversation has a regenerated turn to evaluate: no tau")
            return
        self.plans.put(EvalJob(samples=samples))

    def _install_eval(self, done: EvalDone) -> None:
        """The eval set exists: every worker welcomed while it was pending gets its BATCHes now (later ones
        get them with their WELCOME)."""
        self.eval_batches = done.batches
        self.eval_pending = False
        sent = 0
        for peer in list(self.peers.values()):
            if peer.left:
                continue
            for batch in done.batches:
                if peer.left:
                    break
                if peer.role == "producer":  # computes the features on its own target
                    send_plan(self, peer, eval_plan(batch))
                else:
                    self.out.send(peer.identity, batch)
            sent += 1
        started = self.regen.started if self.regen is not None else None
        since = f", {time.monotonic() - started:.0f} s after the first generation job" if started else ""
        self.note(
            f"eval set ready: {sum(len(b.sample_ids) for b in done.batches)} held-out sample(s) in "
            f"{len(done.batches)} batch(es), sent to {sent} worker(s){since}"
        )

    def finished(self) -> bool:
        """Every epoch trained and, with regeneration, the eval set sent: DONE then comes after the held-out
        BATCHes, so the workers' final evaluation has them."""
        if not self.scheduler.finished():
            return False
        if self.eval_pending and not self._waiting_note:
            self._waiting_note = True
            self.note("all epochs trained; waiting for the held-out set before DONE (the final evaluation)")
        return not self.eval_pending

    def _refill_generation(self) -> None:
        """``jobs_per_thread`` regeneration jobs per target thread at most. On the plain path a replica
        alternates between a job and the feature batches queued meanwhile; on the slot engine it computes
        those batches at each decode check and moves the second job's conversations into the slots the
        first frees. Either way the workers train on the first replies while the rest are generated."""
        if self.regen is None or self.done_sent:
            return
        while self.generating < self.jobs_per_thread * self.target_threads:
            job = self.regen.next_job()
            if job is None:
                return
            self.plans.put(job)
            self.generating += 1

    def dispatch(self) -> None:
        """A leased batch to every worker holding a credit, while there are batches; a plan to every
        attaching producer holding one (``producer.coordinator``)."""
        if self.done_sent:
            return
        lease_plans(self)
        for peer in self.peers.values():
            while peer.credits > 0 and not peer.left and peer.rank >= 0:
                batch = self.scheduler.lease_next(peer.identity, time.monotonic())
                if batch is None:
                    return
                self._send_batch(peer, batch)
                peer.credits -= 1
                self.wire_rate.add(batch.tokens)

    def _send_batch(self, peer: Peer, batch: ReadyBatch) -> None:
        """A BATCH by reference into the ring ``peer`` opened, else as a host copy (``payload_for``)."""
        ring = self.rings.cuda if peer.cuda_ipc else self.rings.shm if peer.shm else None
        payload = payload_for(batch, ring, self.rings.shm)
        self.out.send(peer.identity, payload, ring=ring)
        count_features(peer, payload)
        features = payload.tensors.get("features")
        if ring is not None and features is not None and ring.locate(features) is not None:
            self.sent_by_ref[ring.PATH] += 1

    def send_done(self, reason: str, *, evaluate: bool = True) -> None:
        """``evaluate`` False (a signal's drain): the workers checkpoint and leave without the final evaluation."""
        self.done_sent = True
        for peer in self.peers.values():
            if not peer.left:
                self.out.send(peer.identity, m.Done(reason=reason, evaluate=evaluate))

    def request_checkpoint(self, why: str) -> None:
        """A preemption warning: every worker hears it; rank 0 checkpoints at its next step boundary and the
        run trains on. A step already checkpointed is not written again."""
        peers = [p for p in self.peers.values() if not p.left]
        if not peers:
            self.warn(f"{why}: no worker has joined yet, so there is nothing to checkpoint")
            return
        if self.step == 0:  # workers write no checkpoint of the untrained initialisation
            self.warn(
                f"{why}: nothing is trained yet (step 0), so there is nothing to checkpoint; training goes on"
            )
            return
        for peer in peers:
            self.out.send(peer.identity, m.Checkpoint(step=self.step, path=""))
        self.save_asked = why
        self.warn(f"{why}: checkpoint asked at step {self.step}; training goes on")

    # --- watching ----------------------------------------------------------------------------------------

    def check(self, watch: WorkerWatch | None) -> None:
        """Drops the workers the launcher saw die."""
        if watch is None:
            return
        for name, why in watch.newly_failed():
            peer = next((p for p in self.peers.values() if p.name == name and not p.left), None)
            if peer is not None:
                self.drop(peer, why)
            elif not any(p.name == name for p in self.peers.values()):  # died before its HELLO
                self.lost.append(f"{name} {why}")
                self.note(f"warning: {name} {why.splitlines()[0]}")

    def watch_peers(self) -> None:
        """Heartbeats every ``heartbeat_s``; drops a worker silent for ``peer_timeout_s``; a group that
        waits for ``train.min_workers`` too long stops the run (``producer.min_workers``)."""
        now = time.monotonic()
        watch_group_wait(self, coordinator=not self.ctx.attached, now=now)
        if now - self._last_beat >= self.cfg.wire.heartbeat_s:
            self._last_beat = now
            for peer in self.peers.values():
                if not peer.left:
                    self.out.send(peer.identity, m.Heartbeat(time=time.time()))
        for peer in list(self.peers.values()):
            silent = now - peer.last_heard
            if not peer.left and silent > self.cfg.wire.peer_timeout_s:
                self.drop(
                    peer,
                    f"has been silent for {silent:.0f} s (wire.peer_timeout_s = "
                    f"{self.cfg.wire.peer_timeout_s:.0f}); it is probably dead or hung",
                )

    def observe_waits(self) -> None:
        if self.first_ack is None or self.done_sent:
            return
        active = [p for p in self.peers.values() if not p.left and p.state == "training"]
        idle = max(0, self.target_threads - self.in_target)
        self.waits.observe(
            time.monotonic(),
            target_idle=idle / max(self.target_threads, 1),
            workers_starved=sum(p.credits > 0 for p in active) / max(len(active), 1),
            queue_depth=self.scheduler.ready_count(),
        )
