"""What the producer's core knows of a run: its peers, its scheduler and queues, and the counters the
summary and the dashboard read.

``ProducerCore`` (``producer.core``) is this state plus the steps that change it; the steps that live in
their own modules (``handshake``, ``coordinator``, ``display``) take a ``CoreState``, so they import this
module and not the core that imports them.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from dflash_pipe.data import plan_batches, sample_lengths
from dflash_pipe.producer.regen import GenerateDone, GenerateJob, first_open_epoch
from dflash_pipe.producer.scheduler import BatchScheduler, PlannedBatch, ReadyBatch
from dflash_pipe.producer.setup import RunContext
from dflash_pipe.producer.target_threads import EvalDone, EvalJob, TargetFailure
from dflash_pipe.telemetry import MetricsLogger, RateMeter, RunState, TimeShares
from dflash_pipe.wire import messages as m

if TYPE_CHECKING:
    from dflash_pipe.producer.rings import Rings


@dataclass(slots=True)
class GroupWait:
    """The drafters' group is below ``train.min_workers`` and has taken no step in this launch
    (``producer.min_workers``)."""

    since: float
    """When the producer first heard of it (monotonic)."""
    needed: int
    present: int


@dataclass(slots=True)
class Peer:
    """A worker (or an attaching producer) in the run, as the core tracks it from its HELLO on."""

    identity: bytes
    name: str
    device: str
    host: str
    pid: int
    rank: int = -1
    credits: int = 0
    last_heard: float = field(default_factory=time.monotonic)
    state: str = "joining"
    steps: int = 0
    first_step_s: float | None = None
    left: bool = False
    ring_offered: bool = False
    cuda_offered: bool = False
    shm: bool = False
    """The worker mapped the shared-memory ring: its BATCH headers name slots instead of carrying frames."""
    cuda_ipc: bool = False
    """The worker opened the CUDA IPC ring: its BATCH headers name slots in the target GPU's memory."""
    role: str = "worker"
    """"producer": target replicas attached from another node, leasing PLANs (``producer.coordinator``)."""
    host_id: str = ""
    """Its ``wire.shm.host_identity()``: which node it runs on."""
    same_host: bool = False
    """Same host identity as this producer: what it is sent stays on the node."""
    serves: str = ""
    """An attaching producer's address for the workers of its node (its SERVING), "" until it says: the
    coordinator redirects a worker of that node there (``handshake.redirect_for``)."""
    link_bytes: int = 0
    """Bytes of features sent to this worker, or of plans' tokens to this producer."""
    report: dict[str, float] = field(default_factory=dict)
    """An attaching producer's latest own figures (its links' bytes, its tokens/s)."""


class Outbox(Protocol):
    """How the core talks to workers (the process shell's socket; a list in a test)."""

    def send(self, peer_id: bytes, msg: Any, *, ring: Any = None) -> None:
        """Send ``msg``; a peer that is gone is dropped (``CoreState.drop``), never raised."""
        ...

    def reject(self, peer_id: bytes, reason: str) -> None:
        """Answer REJECT without ever blocking (the peer may not be reading)."""
        ...

    def redirect(self, peer_id: bytes, msg: m.Redirect) -> None:
        """Answer REDIRECT without ever blocking: like REJECT, the last word to a peer that never joins."""
        ...


class CoreState:
    """The run's state as the core keeps it; ``note`` and ``drop`` are here because every step may call them."""

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
        self.out, self.metrics, self.rings = out, metrics, rings
        self.host_id, self.rendezvous = host_id, rendezvous
        self.warn = warn or (lambda _line: None)
        self.peers: dict[bytes, Peer] = {}
        self.regen = ctx.regen
        start_epoch = first_open_epoch(ctx.ledger, self.regen.voids if self.regen else set())
        self.scheduler = BatchScheduler(
            plan_epoch=self._plan_epoch,
            epochs=self.cfg.train.epochs,
            start_epoch=min(start_epoch, self.cfg.train.epochs),
            trained_in_start_epoch=ctx.ledger.trained(start_epoch)
            if start_epoch < ctx.ledger.epochs
            else set(),
            source=plans,
        )
        self.target_rate = RateMeter()
        self.wire_rate = RateMeter()
        self.train_rate = RateMeter()
        self.plans: queue.Queue[PlannedBatch | GenerateJob | EvalJob | None] = queue.Queue()
        self.ready: queue.Queue[ReadyBatch | GenerateDone | EvalDone | TargetFailure] = queue.Queue()
        self.target_threads = 0
        """Target threads taking from ``plans`` (set by the shell when it starts them)."""
        self.jobs_per_thread = 1
        """Generation jobs handed to each target thread at once: 2 where the slot engine decodes (a thread
        takes the second into its free slots while the first finishes), 1 on the plain path."""
        self.generate_seconds: Callable[[], float] = lambda: 0.0
        """The target threads' seconds spent generating so far (set by the process that runs them)."""
        self.in_target = 0
        self.generating = 0
        """Regeneration jobs handed to the target threads and not back yet."""
        self.done_sent = False
        self.state = RunState()
        """What the dashboard shows of the workers' metrics (loss, acc, lr, tau)."""
        self.loss_history: list[float] = []
        self.last_checkpoint: str | None = None
        self.last_checkpoint_at: float | None = None
        """When the latest CHECKPOINT arrived (monotonic): a drain's summary says whether one came after the
        signal."""
        self.save_asked: str | None = None
        """Why a checkpoint was asked of the workers (a preemption signal) and has not arrived yet."""
        self.step = ctx.resume_step
        self.messages: list[str] = []
        self.bye_reason: str | None = None
        self.first_ack: tuple[float, int] | None = None
        self.window_start: tuple[int, float, int, float] | None = None
        """(step, time, acked tokens, produced tokens) at the latest ACK of the first trained step."""
        self.last_ack: tuple[float, int, float] | None = None
        """(time, acked tokens, produced tokens) at the latest ACK."""
        self.waits = TimeShares()
        """From the first ACK to DONE: idle target share, starved worker share, ready queue depth."""
        self.eval_batches: list[m.Batch] = []
        self.eval_pending = self.regen is not None
        """The held-out set is still being regenerated (or its BATCHes computed): workers welcomed
        meanwhile are told so, and get its BATCHes once they exist (``_install_eval``)."""
        self._eval_queued = False
        self._waiting_note = False
        self.attached_first_steps: dict[str, float] = {}
        """Time to the first step of each worker of an attaching producer (its METRICS name it)."""
        self.lost: list[str] = []
        """One line per worker that died or vanished (the run went on without it)."""
        self.redirected = 0
        """Workers sent to the producer of their own node instead of being welcomed here."""
        self.sent_by_ref = {"shm": 0, "cuda_ipc": 0}
        """BATCHes whose features went through each ring (a slot reference) instead of socket frames."""
        self._last_beat = 0.0
        self.group_wait: GroupWait | None = None
        """The drafters wait for ``train.min_workers`` before this launch's first step (``min_workers``)."""

    def _plan_epoch(self, epoch: int, exclude: set[int]) -> Iterable[list[int] | None]:
        if self.regen is not None:
            return self.regen.epoch0(exclude) if epoch == 0 else self.regen.later_epoch(epoch, exclude)
        lengths = sample_lengths(self.ctx.train_samples)
        return plan_batches(
            lengths, self.cfg.data.token_budget, seed=self.cfg.train.seed, epoch=epoch, exclude=exclude
        )

    def note(self, text: str) -> None:
        self.messages = (self.messages + [text])[-5:]

    def drop(self, peer: Peer, why: str) -> None:
        """A worker died or vanished: its leases go back to the queue, the others train on."""
        peer.left = True
        peer.state = "lost"
        released = self.scheduler.release(peer.identity)
        line = f"{peer.role} {peer.name} ({peer.device}, pid {peer.pid}) {why}"
        self.lost.append(line)
        first = line.splitlines()[0]
        self.metrics.log(
            {
                "workers_lost": float(len(self.lost)),
                "released_samples": self.scheduler.stats.released_samples,
            },
            self.step,
        )
        self.note(
            f"warning: {first}; {released} leased {'plan' if peer.role == 'producer' else 'batch'}(es) go to the others"
        )
        self.warn(f"[yellow]warning:[/] {first}; the run goes on without it")
