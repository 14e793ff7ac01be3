"""What a producer process serves with, built once from the run's context.

``ProducerParts`` is the one place that reads the run's config and context for the process shell: it binds
the ROUTER where the run's workers find it (the address recorded in the run dir), starts the drafters'
rendezvous store, opens the metrics sinks and the dashboard, makes the payload rings and builds the
``ProducerCore`` speaking through a ``SocketOutbox``. ``ProducerProc`` takes these parts built and reads no
config of its own; a launch and an attaching producer (``producer.attach``) build theirs here alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from dflash_pipe.data import Sample
from dflash_pipe.producer.core import ProducerCore
from dflash_pipe.producer.rings import make_rings
from dflash_pipe.producer.setup import RunContext
from dflash_pipe.producer.upstream import Upstream
from dflash_pipe.run.dir import RunDir
from dflash_pipe.run.record import bind_address, write_record
from dflash_pipe.run.signals import Signals
from dflash_pipe.target import TargetCore
from dflash_pipe.telemetry import Dashboard, make_logger
from dflash_pipe.wire import messages as m
from dflash_pipe.wire.addresses import store_host
from dflash_pipe.wire.errors import PeerGoneError, SendTimeoutError
from dflash_pipe.wire.shm import host_identity
from dflash_pipe.wire.transport import ProducerEndpoint


def gone_reason(exc: PeerGoneError, send_timeout_s: float) -> str:
    """Why a send to a worker failed, in the words the run's summary shows."""
    if isinstance(exc, SendTimeoutError):
        return (
            f"stopped reading: a message to it waited {send_timeout_s:.0f} s in a full queue "
            "(its process hung, or starved of CPU)"
        )
    return "disconnected: its connection to the producer closed"


class SocketOutbox:
    """The core's outbox over the ROUTER (``producer.parts.Outbox``): a peer found gone by a send is handed to
    ``gone(peer_id, why)``, which drops it; nothing is raised."""

    def __init__(self, endpoint: ProducerEndpoint, gone: Callable[[bytes, str], None]) -> None:
        self.endpoint = endpoint
        self._gone = gone

    def send(self, peer_id: bytes, msg: Any, *, ring: Any = None) -> None:
        """``ring``: the ring the peer opened, so tensors in its slots go by reference."""
        try:
            self.endpoint.send(peer_id, msg, ring=ring)
        except PeerGoneError as exc:
            self._gone(peer_id, gone_reason(exc, self.endpoint.send_timeout_s))

    def reject(self, peer_id: bytes, reason: str) -> None:
        self.endpoint.reject(peer_id, reason)

    def redirect(self, peer_id: bytes, msg: m.Redirect) -> None:
        self.endpoint.try_send(peer_id, msg)


@dataclass(frozen=True, slots=True)
class ServeLimits:
    """The settings the serving loop itself reads: the rest of the config went into the parts it serves with."""

    join_timeout_s: float
    """No worker's HELLO within this long (from the start of serving) aborts the run."""
    stop_timeout_s: float
    """A drain's grace period, as the stop signal's line says it."""
    preempt_signal: str
    """The preemption warning's signal name (``wire.preempt_signal``), for the checkpoint's reason."""


@dataclass(frozen=True, slots=True)
class TargetInputs:
    """What the target threads are started with, besides the replicas."""

    train_samples: Sequence[Sample]
    eval_samples: Sequence[Sample]
    wire_dtype: str
    shared_gpus: bool
    """A target GPU also hosts a drafter worker (regeneration sizes its jobs smaller)."""


class ProducerParts:
    """The built parts of one producer process (see the module docstring); ``ProducerProc(parts)`` serves
    with them."""

    def __init__(
        self,
        ctx: RunContext,
        *,
        replicas: Future[list[TargetCore]],
        signals: Signals,
        own_signals: bool = False,
        console: Any = None,
        live: bool | None = None,
        upstream: Upstream | None = None,
    ) -> None:
        """``replicas``: the target loading (``load_replicas`` started while the data tokenized); serving
        waits for it. ``signals``: installed by the launch already, or (``own_signals``) installed and
        restored by ``serve``. ``upstream``: this producer attaches to a run's coordinator
        (``producer.attach``) and serves the workers of its own node the plans it leases there; it keeps no
        record, store or metrics file of the run's own."""
        cfg, wire = ctx.cfg, ctx.cfg.wire
        self.replicas, self.signals, self.own_signals, self.upstream = (
            replicas,
            signals,
            own_signals,
            upstream,
        )
        bind = wire.bind if upstream else bind_address(cfg.run_dir, wire.bind)
        self.endpoint = ProducerEndpoint(bind, keys=wire.keys, frame_bytes=wire.frame_bytes)
        address = self.endpoint.address
        self.store: torch.distributed.TCPStore | None = None
        if upstream is None:
            write_record(cfg.run_dir, address=address)
            self.store = start_rendezvous_store(address)
            rendezvous = f"tcp://{store_host(address)}:{self.store.port}"
        else:
            rendezvous = upstream.welcome.rendezvous
        run = RunDir(cfg.run_dir) if upstream is None else RunDir(cfg.run_dir).attached(upstream.name)
        self.metrics = make_logger(
            run.metrics,
            cfg.log,
            tensorboard_dir=run.tensorboard,
            config=cfg.to_dict(),
            gpu_devices=[*cfg.layout.target_devices(), *cfg.layout.worker_devices()],
        )
        self.dashboard = Dashboard("dflash-pipe", cfg.train.max_steps, live=live, console=console)
        notes: list[str] = []
        self.rings = make_rings(ctx, notes.append)
        self.outbox = SocketOutbox(self.endpoint, gone=lambda peer_id, why: self.core.drop_gone(peer_id, why))
        self.core = ProducerCore(
            ctx,
            out=self.outbox,
            metrics=self.metrics,
            rings=self.rings,
            host_id=host_identity(),
            rendezvous=rendezvous,
            warn=lambda line: self.dashboard.console.print(line),
            plans=upstream.source() if upstream else None,
        )
        if upstream is not None and (upstream.welcome.eval_batches > 0 or upstream.welcome.eval_pending):
            self.core.leases.await_eval()
        for line in notes:
            self.core.note(line)
        self.targets = TargetInputs(
            train_samples=ctx.train_samples,
            eval_samples=ctx.eval_samples,
            wire_dtype=wire.wire_dtype,
            shared_gpus=bool(cfg.layout.shared_gpus()),
        )
        self.limits = ServeLimits(
            join_timeout_s=wire.join_timeout_s,
            stop_timeout_s=wire.stop_timeout_s,
            preempt_signal=wire.preempt_signal,
        )


def start_rendezvous_store(address: str) -> torch.distributed.TCPStore:
    """The drafters' torch.distributed store lives in the producer, which outlives any worker."""
    return torch.distributed.TCPStore(store_host(address), 0, is_master=True, wait_for_workers=False)
