"""The producer process: serves the wire, routes batches to workers with credits, watches every peer.

``ProducerProc`` knows sockets, threads and signals; the target math lives in ``TargetCore`` and the
routing rules in ``BatchScheduler``. The busy loop is a few named steps: receive, refill, dispatch,
watch, show.

Why it is past 400 lines: sockets, handshake, ring sizing, rendezvous, metrics and the dashboard still live
here together; splitting them is issue 21 (the layering redesign), scheduled after the issues that change
this file.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from dflash_pipe.data import plan_batches
from dflash_pipe.producer.features import TargetFailure, TargetThread, build_batch, load_replicas
from dflash_pipe.producer.payloads import payload_for
from dflash_pipe.producer.regen import GenerateDone, GenerateJob, first_open_epoch
from dflash_pipe.producer.scheduler import BatchScheduler, PlannedBatch, ReadyBatch
from dflash_pipe.producer.setup import RunContext
from dflash_pipe.run.record import bind_address, write_record
from dflash_pipe.target import TargetCore
from dflash_pipe.telemetry import Dashboard, RateMeter, RunState, TimeShares, make_logger
from dflash_pipe.wire import messages as m
from dflash_pipe.wire.addresses import store_host
from dflash_pipe.wire.cuda_ipc import CudaIpcRing
from dflash_pipe.wire.errors import BadMessage, PeerGoneError, SendTimeoutError
from dflash_pipe.wire.ring import RingUnavailable
from dflash_pipe.wire.shm import ShmRing, host_identity
from dflash_pipe.wire.slots import PayloadStaging, PrivateStaging
from dflash_pipe.wire.transport import ProducerEndpoint

_TICK_S = 0.02
_MAX_MESSAGES_PER_TICK = 256
"""Inbound messages handled per loop turn: all that are waiting (up to this), not one, so many fast workers
never leave their ACKs and READYs queued behind the producer's other work."""
_SHOW_EVERY_S = 0.5
MIN_RATE_SPAN_S = 1.0
"""A stage's tokens/s goes into the metrics only once its meter has measured over at least this long."""
_EVAL_BATCH_SAMPLES = 4
TARGET_STOP_TIMEOUT_S = 120.0
"""How long closing waits for each target thread's current batch (a forward of a big target, or its compile)."""
REQUIRED_CAPABILITIES = ("frames",)
"""What a worker must support: payloads as raw tensor frames on the socket."""


def drain(
    recv: Callable[[float], tuple[bytes, Any] | None],
    handle: Callable[[bytes, Any], None],
    *,
    limit: int,
    wait_s: float = _TICK_S,
) -> int:
    """Handles every message already waiting, up to ``limit``: the first receive waits up to ``wait_s``,
    the rest take only what is there. Returns how many were handled."""
    handled = 0
    got = recv(wait_s)
    while got is not None:
        handle(*got)
        handled += 1
        if handled >= limit:
            break
        got = recv(0.0)
    return handled


def gone_reason(exc: PeerGoneError, send_timeout_s: float) -> str:
    """Why a send to a worker failed, in the words the run's summary shows."""
    if isinstance(exc, SendTimeoutError):
        return (
            f"stopped reading: a message to it waited {send_timeout_s:.0f} s in a full queue "
            "(its process hung, or starved of CPU)"
        )
    return "disconnected: its connection to the producer closed"


class RunAborted(RuntimeError):
    """Every worker is gone, or a target replica failed; the run stopped (resume from the last checkpoint)."""


class WorkerWatch(Protocol):
    """What the launcher tells the producer about the worker processes it started."""

    def newly_failed(self) -> list[tuple[str, str]]:
        """(worker name, what happened) for each launched worker that died since the last call."""
        ...

    def alive(self) -> int:
        """Launched workers still running (some may not have said HELLO yet)."""
        ...


@dataclass(slots=True)
class Peer:
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


@dataclass(slots=True)
class ProducerSummary:
    steps: int
    stop_reason: str
    wall_s: float
    last_checkpoint: str | None
    first_step_s: dict[str, float]
    acked_tokens: int
    duplicates_redelivered: int
    steady_tokens_per_s: float
    """Trained tokens/s from the first ACK to the end: the pipeline's rate once every worker is warm."""
    ack_window_s: float = 0.0
    """Seconds from the end of the first trained step (its last ACK) to the last ACK: every worker's first
    step (compile, warm-up) and the end's checkpoint and eval are left out."""
    ack_window_tokens: int = 0
    """Tokens acknowledged in that window: their ratio is the pipeline's training rate."""
    produced_window_tokens: int = 0
    """Tokens the target replicas finished in the same window. Over a short window the ready queue built
    during start-up can feed the workers faster than the target produces; the smaller of the two counts is
    what the pipeline sustains."""
    waits: dict[str, float] = field(default_factory=dict)
    """Where time went between the first ACK and DONE (see ``ProducerProc.wait_report``)."""
    regen: dict[str, Any] = field(default_factory=dict)
    """With ``data.responses = "target"``: what regeneration did (``Regeneration.summary``)."""


class ProducerProc:
    def __init__(
        self,
        ctx: RunContext,
        *,
        console: Any = None,
        live: bool | None = None,
        replicas: Future[list[TargetCore]] | None = None,
    ) -> None:
        """``replicas``: the target already loading (``load_replicas`` started while the data tokenized);
        ``serve`` waits for it (default: loaded in ``serve``)."""
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.endpoint = ProducerEndpoint(
            bind_address(self.cfg.run_dir, self.cfg.wire.bind),
            keys=self.cfg.wire.keys,
            frame_bytes=self.cfg.wire.frame_bytes,
        )
        self.host_id = host_identity()
        self.address = self.endpoint.address
        write_record(self.cfg.run_dir, address=self.address)
        self._store = _start_rendezvous_store(self.address)
        self.rendezvous = f"tcp://{store_host(self.address)}:{self._store.port}"
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
        )
        self.metrics = make_logger(
            self.cfg.run_dir,
            self.cfg.log,
            config=self.cfg.to_dict(),
            gpu_devices=[*self.cfg.layout.target_devices(), *self.cfg.layout.worker_devices()],
        )
        self.dashboard = Dashboard("dflash-pipe", self.cfg.train.max_steps, live=live, console=console)
        self.target_rate = RateMeter()
        self.wire_rate = RateMeter()
        self.train_rate = RateMeter()
        self._plans: queue.Queue[PlannedBatch | GenerateJob | None] = queue.Queue()
        self._ready: queue.Queue[ReadyBatch | GenerateDone | TargetFailure] = queue.Queue()
        self._in_target = 0
        self._generating = 0
        """Regeneration jobs handed to the target threads and not back yet."""
        self._threads: list[TargetThread] = []
        self._cores: list[TargetCore] = []
        self._replicas = replicas
        self._stop_requested = threading.Event()
        self._done_sent = False
        self._state = RunState()
        self._loss_history: list[float] = []
        self._last_checkpoint: str | None = None
        self._step = ctx.resume_step
        self._messages: list[str] = []
        self._closed = False
        self._started = time.monotonic()
        self._last_beat = 0.0
        self._bye_reason: str | None = None
        self._first_ack: tuple[float, int] | None = None
        self._window_start: tuple[int, float, int, float] | None = None
        """(step, time, acked tokens, produced tokens) at the latest ACK of the first trained step."""
        self._last_ack: tuple[float, int, float] | None = None
        """(time, acked tokens, produced tokens) at the latest ACK."""
        self.waits = TimeShares()
        """From the first ACK to DONE: idle target share, starved worker share, ready queue depth."""
        self._eval_batches: list[m.Batch] = []
        self._lost: list[str] = []
        """One line per worker that died or vanished (the run went on without it)."""
        self.cuda_ring = self._make_cuda_ring()
        self.ring = self._make_ring()
        self.staging: PayloadStaging = self.cuda_ring or self.ring or PrivateStaging()
        """Memory the target threads copy features into: the CUDA IPC ring when there is one, else the
        shared-memory ring (same-host workers read the slots directly), else private pinned buffers; the
        producer closes it."""
        self._sent_by_ref = {"shm": 0, "cuda_ipc": 0}
        """BATCHes whose features went through each ring (a slot reference) instead of socket frames."""

    # --- set-up ----------------------------------------------------------------------------------------

    def _plan_epoch(self, epoch: int, exclude: set[int]) -> Iterable[list[int] | None]:
        if self.regen is not None:
            return self.regen.epoch0(exclude) if epoch == 0 else self.regen.later_epoch(epoch, exclude)
        lengths = [int(s.input_ids.numel()) for s in self.ctx.train_samples]
        return plan_batches(
            lengths, self.cfg.data.token_budget, seed=self.cfg.train.seed, epoch=epoch, exclude=exclude
        )

    def _ring_shape(self) -> tuple[int, int]:
        """(slots, slot bytes) of a payload ring. A slot holds the largest possible batch; there are enough
        slots for the batches computed ahead, those in the target threads and every launched worker's
        credits, so the ring rarely applies back-pressure."""
        wire = self.cfg.wire
        longest = (
            self.cfg.data.max_length  # regenerated samples: not known yet, at most max_length
            if self.regen is not None
            else max(int(s.input_ids.numel()) for s in self.ctx.train_samples)
        )
        tokens = max(self.cfg.data.token_budget, longest)
        k, width = len(self.ctx.drafter.target_layer_ids), self.ctx.drafter.feature_size
        per_token = width * (1 if wire.wire_dtype == "fp8" else self.ctx.target_dtype.itemsize) + 4 * k
        replicas = max(1, len(self.cfg.layout.target_devices()))
        drafters = max(1, len(self.cfg.layout.worker_devices()))  # threaded mode: one process, many drafters
        slots = wire.ready_batches + 2 * replicas + wire.worker_credits * drafters + 1
        return slots, tokens * per_token + 4096

    def _make_ring(self) -> ShmRing | None:
        """The shared-memory ring same-host workers read payloads from (with payload_path auto or shm)."""
        wire = self.cfg.wire
        if wire.payload_path not in ("auto", "shm"):
            return None
        try:
            return ShmRing.create(*self._ring_shape())
        except (RingUnavailable, OSError) as exc:
            if wire.payload_path == "shm":
                raise RunAborted(f"wire.payload_path is shm, but no shared-memory ring: {exc}") from exc
            self._note(f"shared-memory ring unavailable ({exc}); payloads go as frames")
            return None

    def _make_cuda_ring(self) -> CudaIpcRing | None:
        """The ring in the (first) target GPU's memory that same-host CUDA workers open with CUDA IPC (with
        payload_path auto or cuda_ipc, when the target runs on CUDA). Target replicas on other GPUs copy
        into it peer to peer."""
        wire = self.cfg.wire
        if wire.payload_path not in ("auto", "cuda_ipc"):
            return None
        device = torch.device(self.cfg.layout.target_devices()[0])
        try:
            if device.type != "cuda":
                raise RingUnavailable(f"the target runs on {device}, not on a GPU")
            return CudaIpcRing.create(*self._ring_shape(), device)
        except (RingUnavailable, RuntimeError) as exc:
            if wire.payload_path == "cuda_ipc":
                raise RunAborted(f"wire.payload_path is cuda_ipc, but no CUDA IPC ring: {exc}") from exc
            if device.type == "cuda":
                self._note(f"CUDA IPC ring unavailable ({exc}); same-host payloads use shared memory")
            return None

    def start_targets(self) -> None:
        """One TargetCore per replica (a GPU, or a group of GPUs for a split target), each fed by its own
        thread."""
        self._cores = self._replicas.result() if self._replicas is not None else load_replicas(self.ctx)
        placed = ", ".join("+".join(str(d) for d in core.devices) for core in self._cores)
        self._note(f"target: {len(self._cores)} replica(s) on {placed}")
        for core in self._cores:
            thread = TargetThread(
                core,
                self.ctx.train_samples,
                self._plans,
                self._ready,
                self.target_rate,
                name=str(core.device),
                staging=self.staging,
                wire_dtype=self.cfg.wire.wire_dtype,
                make_generator=self.regen.make_generator if self.regen is not None else None,
            )
            thread.start()
            self._threads.append(thread)

    def _build_eval_batches(self) -> list[m.Batch]:
        samples = self.ctx.eval_samples
        out = []
        for start in range(0, len(samples), _EVAL_BATCH_SAMPLES):
            chunk = samples[start : start + _EVAL_BATCH_SAMPLES]
            plan = PlannedBatch(batch_id=len(out), epoch=0, sample_ids=[s.sample_id for s in chunk])
            out.append(
                build_batch(self._cores[0], plan, chunk, for_eval=True, wire_dtype=self.cfg.wire.wire_dtype)
            )
        return out

    # --- serving -----------------------------------------------------------------------------------------

    def serve(self, watch: WorkerWatch | None = None) -> ProducerSummary:
        """Runs until training finishes, Ctrl-C drains it, or every worker is gone (RunAborted).

        Workers may join at any time (``dflash-pipe worker --connect``) and leave or die at any time: a lost
        worker's leases go back to the queue and the others train on."""
        started = self._started = time.monotonic()
        previous = _install_sigint(self._stop_requested)
        try:
            self.start_targets()
            if self.regen is not None:
                self._regenerate_eval()
            self._eval_batches = self._build_eval_batches() if self.ctx.eval_samples else []
            stop_reason = self._run(watch)
        finally:
            _restore_sigint(previous)
        return ProducerSummary(
            steps=self._step,
            stop_reason=stop_reason,
            wall_s=time.monotonic() - started,
            last_checkpoint=self._last_checkpoint,
            first_step_s={p.name: p.first_step_s for p in self.peers.values() if p.first_step_s is not None},
            acked_tokens=self.scheduler.stats.acked_tokens,
            duplicates_redelivered=self.scheduler.stats.redelivered,
            steady_tokens_per_s=self._steady_rate(),
            **self._ack_window(),
            waits=self.wait_report(),
            regen=self.regen.summary() if self.regen is not None else {},
        )

    def _regenerate_eval(self) -> None:
        """The held-out conversations regenerated on the first replica before serving (the eval batches are
        built once, from them)."""
        regen = self.regen
        assert regen is not None
        todo = len(regen.source.conversations) - regen.num_train
        if todo:
            self._note(f"regenerating the {todo} held-out conversation(s) for the eval set")
        self.ctx.eval_samples = regen.regenerate_eval(regen.make_generator(self._cores[0]))
        if why := regen.nothing_to_train():  # a reused file that holds nothing trainable
            raise RunAborted(why)

    def _ack_window(self) -> dict[str, float]:
        if self._window_start is None or self._last_ack is None:
            return {}
        _, t0, acked0, produced0 = self._window_start
        t1, acked1, produced1 = self._last_ack
        return {
            "ack_window_s": t1 - t0,
            "ack_window_tokens": acked1 - acked0,
            "produced_window_tokens": int(produced1 - produced0),
        }

    def wait_report(self) -> dict[str, float]:
        """Shares of the observed time: target replicas idle (the ready queue at its bound, waiting for
        credits), workers holding unused credits (waiting for batches), and the mean ready-queue depth; the
        replicas' busy seconds, and of those the seconds spent regenerating conversations."""
        busy = sum(t.busy_s for t in self._threads)
        return {
            "observed_s": self.waits.elapsed_s,
            "target_idle_share": self.waits.mean("target_idle"),
            "workers_starved_share": self.waits.mean("workers_starved"),
            "queue_depth_mean": self.waits.mean("queue_depth"),
            "target_busy_s": busy,
            "target_generate_s": sum(t.generate_s for t in self._threads),
        }

    def _observe_waits(self) -> None:
        if self._first_ack is None or self._done_sent:
            return
        active = [p for p in self.peers.values() if not p.left and p.state == "training"]
        idle = max(0, len(self._threads) - self._in_target)
        self.waits.observe(
            time.monotonic(),
            target_idle=idle / max(len(self._threads), 1),
            workers_starved=sum(p.credits > 0 for p in active) / max(len(active), 1),
            queue_depth=self.scheduler.ready_count(),
        )

    def _steady_rate(self) -> float:
        if self._first_ack is None:
            return 0.0
        t0, tokens0 = self._first_ack
        elapsed = time.monotonic() - t0
        return (self.scheduler.stats.acked_tokens - tokens0) / elapsed if elapsed > 0 else 0.0

    def _run(self, watch: WorkerWatch | None) -> str:
        stop_reason = "finished"
        last_show = 0.0
        join_deadline = time.monotonic() + self.cfg.wire.join_timeout_s
        while True:
            self._check(watch)
            if not self.peers and time.monotonic() > join_deadline:
                raise RunAborted(
                    f"no worker said HELLO within {self.cfg.wire.join_timeout_s:.0f} s "
                    "(wire.join_timeout_s); see RUN_DIR/logs for their output."
                )
            if self._stop_requested.is_set() and not self._done_sent:
                stop_reason = "interrupted (Ctrl-C): checkpoint written, resume with --resume"
                self._send_done("interrupted by the user")
            self._take_ready()
            self._refill()
            drain(self._recv, self._handle, limit=_MAX_MESSAGES_PER_TICK)
            self._dispatch()
            self._observe_waits()
            if self.scheduler.finished() and not self._done_sent:
                self._send_done("all epochs trained")
            self._watch_peers()
            now = time.monotonic()
            if now - last_show >= _SHOW_EVERY_S:
                self._show()
                last_show = now
            if all(p.left for p in self.peers.values()):
                if self._lost and not self._done_sent:
                    if watch is None or watch.alive() == 0:
                        raise RunAborted("every worker is gone:\n" + "\n".join(self._lost))
                    continue  # a launched worker is still starting up
                if not self.peers:
                    continue
                if not self._done_sent and not self.scheduler.finished():
                    stop_reason = self._bye_reason or "every worker left"
                return stop_reason

    def _recv(self, timeout_s: float) -> tuple[bytes, Any] | None:
        try:
            return self.endpoint.recv(timeout_s=timeout_s)
        except BadMessage as exc:
            self._note(f"bad message from peer {exc.peer!r}: {exc}")
            if exc.peer is not None:
                self.endpoint.reject(exc.peer, str(exc))  # never blocks: the peer may not be reading
            return None

    def _hello(self, peer_id: bytes, msg: m.Hello) -> Peer | None:
        if msg.protocol_version != m.PROTOCOL_VERSION:
            self.endpoint.reject(
                peer_id, f"protocol {msg.protocol_version} != producer's {m.PROTOCOL_VERSION}"
            )
            return None
        missing = sorted(set(REQUIRED_CAPABILITIES) - set(msg.capabilities))
        if missing:
            self.endpoint.reject(peer_id, f"worker lacks capabilities {missing}; upgrade dflash-pipe there")
            return None
        if self._done_sent:
            self.endpoint.reject(peer_id, "this run is finishing; attach to the next one")
            return None
        try:
            cuda_offered, ring_offered = choose_offers(
                self.cfg.wire.payload_path,
                msg.capabilities,
                same_host=bool(self.host_id) and msg.host_id == self.host_id,
                cuda_ring=self.cuda_ring is not None,
                shm_ring=self.ring is not None,
            )
        except ValueError as exc:
            self.endpoint.reject(peer_id, str(exc))
            return None
        peer = Peer(identity=peer_id, name=msg.worker_name, device=msg.device, host=msg.host, pid=msg.pid)
        peer.cuda_offered, peer.ring_offered = cuda_offered, ring_offered
        self.peers[peer_id] = peer
        # Ranks come from the drafters' rendezvous, not from here: WELCOME's rank/world_size are the
        # arrival order, for logs. Every worker gets the eval set, since any of them may become rank 0.
        peer.rank = sum(1 for p in self.peers.values() if not p.left) - 1
        peer.state = "starting"
        # Through _send: a peer that hangs up right after its HELLO is dropped, never fatal.
        self._send(peer.identity, self._welcome(peer, peer.rank + 1, len(self._eval_batches)))
        for batch in self._eval_batches:
            if peer.left:
                break
            self._send(peer.identity, batch)
        if self._step > 0:
            self._note(f"{peer.name} ({peer.device}) joins the run at step {self._step}")
        return peer

    def _welcome(self, peer: Peer, world_size: int, eval_batches: int) -> m.Welcome:
        d = self.ctx.drafter
        return m.Welcome(
            run_id=self.ctx.run_id,
            rank=peer.rank,
            world_size=world_size,
            rendezvous=self.rendezvous,
            run_dir=str(self.cfg.run_dir.resolve()),
            target_path=str(Path(self.ctx.target_path).resolve()),
            feature_dtype=str(self.ctx.target_dtype).removeprefix("torch."),
            hidden_size=d.hidden_size,
            target_layer_ids=list(d.target_layer_ids),
            vocab_size=d.vocab_size,
            mask_token_id=d.mask_token_id,
            block_size=d.block_size,
            drafter=d.to_dict(),
            train=_train_dict(self.cfg),
            resume_from=self._last_checkpoint
            or (str(self.ctx.resume_from) if self.ctx.resume_from else None),
            heartbeat_s=self.cfg.wire.heartbeat_s,
            peer_timeout_s=self.cfg.wire.peer_timeout_s,
            num_samples=len(self.ctx.train_samples),
            credits=self.cfg.wire.worker_credits,
            eval_batches=eval_batches,
            wire_dtype=self.cfg.wire.wire_dtype,
            ring=self.ring.offer().to_dict() if peer.ring_offered and self.ring is not None else {},
            cuda_ring=(
                self.cuda_ring.offer().to_dict() if peer.cuda_offered and self.cuda_ring is not None else {}
            ),
        )

    def _handle(self, peer_id: bytes, msg: Any) -> None:
        peer = self.peers.get(peer_id)
        if peer is None or peer.left:
            if isinstance(msg, m.Hello):
                self._hello(peer_id, msg)
            elif not isinstance(msg, (m.Heartbeat, m.Bye, m.Error)):
                self.endpoint.reject(peer_id, "say HELLO first")
            return
        peer.last_heard = time.monotonic()
        if isinstance(msg, m.Ready):
            if peer.state == "starting":  # the first READY says which ring the worker could open
                self._ready_paths(peer, msg)
            peer.credits += msg.credits
            peer.state = "training"
        elif isinstance(msg, m.Ack):
            tokens_before = self.scheduler.stats.acked_tokens
            self.scheduler.ack(peer_id, msg.batch_ids)
            if self._first_ack is None:
                self._first_ack = (time.monotonic(), self.scheduler.stats.acked_tokens)
            now, acked, produced = time.monotonic(), self.scheduler.stats.acked_tokens, self.target_rate.total
            if self._window_start is None or self._window_start[0] == msg.step:
                self._window_start = (msg.step, now, acked, produced)
            self._last_ack = (now, acked, produced)
            self.train_rate.add(self.scheduler.stats.acked_tokens - tokens_before)
            peer.steps = msg.step
            self._step = max(self._step, msg.step)
        elif isinstance(msg, m.Metrics):
            self._metrics(peer, msg)
        elif isinstance(msg, m.Checkpoint):
            self._last_checkpoint = msg.path
        elif isinstance(msg, m.Error):
            self._drop(peer, f"failed: {msg.message}\n{msg.traceback}")
        elif isinstance(msg, m.Bye):
            self._bye_reason = self._bye_reason or msg.reason
            peer.left = True
            peer.state = "left"
            self.scheduler.release(peer_id)
        elif isinstance(msg, m.Hello):
            self._send(peer_id, m.Reject(reason="already joined"))

    def _metrics(self, peer: Peer, msg: m.Metrics) -> None:
        values, bad = _checked_metrics(msg.values)
        if bad:
            self._note(f"worker {peer.name} sent malformed metrics {bad}; ignored them")
        if "time_to_first_step_s" in values:
            peer.first_step_s = float(values["time_to_first_step_s"])
            values = {f"time_to_first_step_s/{peer.name}": peer.first_step_s}
        if "loss" in values:
            self._loss_history.append(float(values["loss"]))
            self._state.loss = float(values["loss"])
            self._state.acc = list(values.get("acc", []))
            self._state.lr = float(values.get("lr", 0.0))
            values.update(self._stage_rates())
            values["queue_depth"] = self.scheduler.ready_count()
            values["leased"] = self.scheduler.leased_count()
            values["batches_via_shm"] = self._sent_by_ref["shm"]
            values["batches_via_cuda_ipc"] = self._sent_by_ref["cuda_ipc"]
            waits = self.wait_report()
            values["wait/target_idle_share"] = waits["target_idle_share"]
            values["wait/workers_starved_share"] = waits["workers_starved_share"]
            if self.regen is not None:
                values.update({f"regen/{k}": v for k, v in self.regen.status().items()})
        if "simulated/tau" in values:
            self._state.tau = float(values["simulated/tau"])
        if "real/tau" in values:
            self._state.real_tau = float(values["real/tau"])
        if values.get("real/lossless_mismatches"):
            self._note(
                f"REAL EVAL NOT LOSSLESS at step {msg.step}: {values['real/lossless_mismatches']:.0f} prompt(s) "
                "decoded other tokens than the target's greedy decoding (see the rank-0 worker log)"
            )
        self.metrics.log(values, msg.step)

    def _stage_rates(self) -> dict[str, float]:
        """Each stage's tokens/s, once its meter spans ``MIN_RATE_SPAN_S`` (the first step's record has none:
        its two ACKs a millisecond apart once logged 1.57M tokens/s for the demo)."""
        meters = {
            "tokens_per_s": self.train_rate,
            "tokens_per_s/producer": self.target_rate,
            "tokens_per_s/wire": self.wire_rate,
            "tokens_per_s/drafters": self.train_rate,
        }
        return {key: meter.rate() for key, meter in meters.items() if meter.span() >= MIN_RATE_SPAN_S}

    # --- routing -----------------------------------------------------------------------------------------

    def _take_ready(self) -> None:
        while True:
            try:
                item = self._ready.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, TargetFailure):
                raise RunAborted(f"target replica {item.replica} failed: {item.error!r}") from item.error
            if isinstance(item, GenerateDone):
                self._generating -= 1
                note = self.regen.accept(item)  # type: ignore[union-attr]
                if note:
                    self._note(note)
                if why := self.regen.nothing_to_train():  # type: ignore[union-attr]
                    raise RunAborted(why)
                continue
            self._in_target -= 1
            self.scheduler.add_ready(item)

    def _refill(self) -> None:
        """Keeps ``ready_batches`` computed plus two plans per target thread in computation, so no replica
        waits on us: all threads take from one queue (an idle one takes the next plan), and each holds one
        batch whose copy drains while it computes the next (``TargetThread``)."""
        while self._in_target + self.scheduler.ready_count() < self.cfg.wire.ready_batches + 2 * len(
            self._threads
        ):
            if self._done_sent:
                return
            plan = self.scheduler.next_plan()
            if plan is None:
                break
            self._plans.put(plan)
            self._in_target += 1
        self._refill_generation()

    def _refill_generation(self) -> None:
        """One regeneration job per target thread at most: each replica alternates between generating and
        the feature batches queued meanwhile, so the workers train on the first replies while the rest
        are generated."""
        if self.regen is None or self._done_sent:
            return
        while self._generating < len(self._threads):
            job = self.regen.next_job()
            if job is None:
                return
            self._plans.put(job)
            self._generating += 1

    def _dispatch(self) -> None:
        if self._done_sent:
            return
        for peer in self.peers.values():
            while peer.credits > 0 and not peer.left and peer.rank >= 0:
                batch = self.scheduler.lease_next(peer.identity, time.monotonic())
                if batch is None:
                    return
                self._send_batch(peer, batch)
                peer.credits -= 1
                self.wire_rate.add(batch.tokens)

    def _send_done(self, reason: str) -> None:
        self._done_sent = True
        for peer in self.peers.values():
            if not peer.left:
                self._send(peer.identity, m.Done(reason=reason))

    def _ready_paths(self, peer: Peer, msg: m.Ready) -> None:
        peer.cuda_ipc = msg.cuda_ipc and peer.cuda_offered
        peer.shm = msg.shm and peer.ring_offered and not peer.cuda_ipc
        if peer.cuda_offered and not peer.cuda_ipc:
            fallback = "shared memory" if peer.shm else "frames"
            self._note(
                f"warning: {peer.name} could not open the CUDA IPC ring (see its log); its payloads go "
                f"through {fallback}"
            )

    def _send_batch(self, peer: Peer, batch: ReadyBatch) -> None:
        """A BATCH by reference into the ring ``peer`` opened, else as a host copy (``payload_for``)."""
        ring = self.cuda_ring if peer.cuda_ipc else self.ring if peer.shm else None
        payload = payload_for(batch, ring, self.ring)
        self._send(peer.identity, payload, ring=ring)
        features = payload.tensors.get("features")
        if ring is not None and features is not None and ring.locate(features) is not None:
            self._sent_by_ref[ring.PATH] += 1

    def _send(self, peer_id: bytes, msg: Any, *, ring: Any = None) -> None:
        """``ring``: the ring the peer opened, so tensors in its slots go by reference."""
        try:
            self.endpoint.send(peer_id, msg, ring=ring)
        except PeerGoneError as exc:
            peer = self.peers.get(peer_id)
            if peer is not None and not peer.left:
                self._drop(peer, gone_reason(exc, self.endpoint.send_timeout_s))

    # --- watching ----------------------------------------------------------------------------------------

    def _check(self, watch: WorkerWatch | None) -> None:
        if watch is None:
            return
        for name, why in watch.newly_failed():
            peer = next((p for p in self.peers.values() if p.name == name and not p.left), None)
            if peer is not None:
                self._drop(peer, why)
            elif not any(p.name == name for p in self.peers.values()):  # died before its HELLO
                self._lost.append(f"{name} {why}")
                self._note(f"warning: {name} {why.splitlines()[0]}")

    def _drop(self, peer: Peer, why: str) -> None:
        """A worker died or vanished: its leases go back to the queue, the others train on."""
        peer.left = True
        peer.state = "lost"
        released = self.scheduler.release(peer.identity)
        line = f"worker {peer.name} ({peer.device}, pid {peer.pid}) {why}"
        self._lost.append(line)
        first = line.splitlines()[0]
        self.metrics.log(
            {
                "workers_lost": float(len(self._lost)),
                "released_samples": self.scheduler.stats.released_samples,
            },
            self._step,
        )
        self._note(f"warning: {first}; {released} leased batch(es) go to the others")
        self.dashboard.console.print(f"[yellow]warning:[/] {first}; the run goes on without it")

    def _heartbeat_all(self) -> None:
        for peer in self.peers.values():
            if not peer.left:
                self._send(peer.identity, m.Heartbeat(time=time.time()))

    def _watch_peers(self) -> None:
        now = time.monotonic()
        if now - self._last_beat >= self.cfg.wire.heartbeat_s:
            self._last_beat = now
            self._heartbeat_all()
        for peer in list(self.peers.values()):
            silent = now - peer.last_heard
            if not peer.left and silent > self.cfg.wire.peer_timeout_s:
                self._drop(
                    peer,
                    f"has been silent for {silent:.0f} s (wire.peer_timeout_s = "
                    f"{self.cfg.wire.peer_timeout_s:.0f}); it is probably dead or hung",
                )

    def _note(self, text: str) -> None:
        self._messages = (self._messages + [text])[-5:]

    def _show(self) -> None:
        s = self._state
        s.step = self._step
        total = self.ctx.ledger.num_samples * self.cfg.train.epochs
        done = self.ctx.ledger.total_trained() + self.scheduler.stats.acked_samples
        s.progress = min(1.0, done / total)
        if self.cfg.train.max_steps:
            s.progress = max(s.progress, min(1.0, self._step / self.cfg.train.max_steps))
        s.elapsed_s = time.monotonic() - self._started
        s.eta_s = s.elapsed_s * (1 - s.progress) / s.progress if s.progress > 0 else None
        meters = {"producer": self.target_rate, "wire": self.wire_rate, "drafters": self.train_rate}
        s.tokens_per_s = {k: m.rate() for k, m in meters.items() if m.span() >= MIN_RATE_SPAN_S}
        s.queue_depth = self.scheduler.ready_count()
        s.leased = self.scheduler.leased_count()
        s.workers = [
            {
                "name": p.name,
                "rank": p.rank,
                "device": p.device,
                "state": p.state,
                "steps": p.steps,
                "first_step_s": p.first_step_s,
            }
            for p in self.peers.values()
        ]
        s.messages = list(self._messages)
        s.regen = self.regen.status() if self.regen is not None else None
        self.dashboard.update(s)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_targets()
        self.dashboard.close()
        self.metrics.close()
        if self.regen is not None:
            self.regen.store.close()
        self.endpoint.close()
        self.staging.close()
        for ring in (self.ring, self.cuda_ring):  # closing the staging twice is a no-op
            if ring is not None:
                ring.close()

    def _stop_targets(self) -> None:
        """Target threads end before the staging memory is freed and before the process exits: the plans
        not started are dropped, each thread finishes the batch it computes. (A daemon thread still inside
        the target's forward when the interpreter exits aborts the process with SIGABRT; a thread copying
        into a freed slot would crash it.)"""
        for thread in self._threads:
            thread.stop()
        with contextlib.suppress(queue.Empty):
            while True:
                self._plans.get_nowait()
        for _ in self._threads:
            self._plans.put(None)  # wakes a thread waiting for a plan
        deadline = time.monotonic() + TARGET_STOP_TIMEOUT_S
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if stuck := [t.name for t in self._threads if t.is_alive()]:
            self._note(
                f"target thread(s) {', '.join(stuck)} still computing after {TARGET_STOP_TIMEOUT_S:.0f} s; "
                "exiting anyway"
            )


def choose_offers(
    payload_path: str, capabilities: list[str], *, same_host: bool, cuda_ring: bool, shm_ring: bool
) -> tuple[bool, bool]:
    """(offer the CUDA IPC ring, offer the shared-memory ring) to a worker that says HELLO with
    ``capabilities``; ``ValueError`` (the reason to REJECT it) when ``payload_path`` demands a ring the
    worker cannot share. The worker opens the first it can (CUDA IPC, then shm) and says which in READY."""
    can_shm = same_host and "shm" in capabilities
    can_cuda = same_host and "cuda_ipc" in capabilities
    if payload_path == "shm" and not can_shm:
        raise ValueError(
            "wire.payload_path is shm, but this worker cannot share the producer's memory (another "
            "host, container or pid namespace); launch with --payload-path auto to send it frames"
        )
    if payload_path == "cuda_ipc" and not can_cuda:
        raise ValueError(
            "wire.payload_path is cuda_ipc, but this worker cannot open the producer's GPU memory (another "
            "host, container or pid namespace, or it trains on CPU); launch with --payload-path auto"
        )
    return can_cuda and cuda_ring, can_shm and shm_ring


def _train_dict(cfg: Any) -> dict[str, Any]:
    return cfg.to_dict()["train"]


LIST_METRICS = frozenset({"acc", "simulated/acceptance_per_slot", "real/acceptance_per_position"})
"""Metrics that are per-slot lists; every other metric is one number."""


def _checked_metrics(values: dict) -> tuple[dict, list[str]]:
    """Keeps well-shaped metrics (numbers, or lists of numbers where a list is expected) and names the rest,
    so a confused or buggy worker cannot take the producer down with a bad METRICS message."""

    def number(v: object) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    good, bad = {}, []
    for key, value in values.items():
        ok = isinstance(value, list) and all(map(number, value)) if key in LIST_METRICS else number(value)
        if ok:
            good[key] = value
        else:
            bad.append(key)
    return good, bad


def _start_rendezvous_store(address: str) -> torch.distributed.TCPStore:
    """The drafters' torch.distributed store lives in the producer, which outlives any worker."""
    return torch.distributed.TCPStore(store_host(address), 0, is_master=True, wait_for_workers=False)


def _install_sigint(event: threading.Event) -> Any:
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, _frame: object) -> None:
        if event.is_set():
            raise KeyboardInterrupt
        event.set()

    return signal.signal(signal.SIGINT, handler)


def _restore_sigint(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGINT, previous)
