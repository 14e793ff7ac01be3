"""``dflash-pipe producer --connect``: target replicas on another node, attached to a running run.

The producer joins the run's coordinator (the first producer, ``launch``) as a worker joins a producer:
HELLO with role "producer", WELCOME with the run's config. It then runs a ``ProducerProc`` of its own for
the workers of its node (started here, or attached to it with ``worker --connect``): they train in the
run's one drafter group (the coordinator's rendezvous), take their features from this producer through
shared memory or CUDA IPC, and their ACKs go back to the coordinator through it (``producer.upstream``).
The run dir must be on storage every node sees (checkpoints, the demo target, the compile cache).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dflash_pipe.compute.precision import compute_dtype
from dflash_pipe.cpus import threads_per_process
from dflash_pipe.data import LoadedData
from dflash_pipe.drafter import DrafterConfig
from dflash_pipe.producer.display import ProducerSummary
from dflash_pipe.producer.handshake import REQUIRED_CAPABILITIES
from dflash_pipe.producer.setup import RunContext
from dflash_pipe.producer.upstream import LeasedSamples, Upstream
from dflash_pipe.run.config import RunConfig
from dflash_pipe.run.dir import RunDir
from dflash_pipe.run.layout import LayoutConfig
from dflash_pipe.run.ledger import Ledger
from dflash_pipe.run.signals import Signals
from dflash_pipe.wire import messages as m
from dflash_pipe.wire.auth import AuthError
from dflash_pipe.wire.shm import host_identity
from dflash_pipe.wire.transport import WorkerEndpoint
from dflash_pipe.wire.welcome import await_welcome


class AttachError(RuntimeError):
    """The coordinator refused this producer, never answered, or its run cannot be served from here."""


def join(endpoint: WorkerEndpoint, *, name: str, devices: list[str], timeout_s: float) -> m.Welcome:
    """HELLO as a producer; the WELCOME, or ``AttachError`` naming why none came (its CURVE keys refused
    as a worker's would be, a REJECT, no answer in ``timeout_s``)."""
    try:
        return _join(endpoint, name=name, devices=devices, timeout_s=timeout_s)
    except AuthError as exc:
        raise AttachError(str(exc).replace("this worker", "this producer")) from None


def _join(endpoint: WorkerEndpoint, *, name: str, devices: list[str], timeout_s: float) -> m.Welcome:
    endpoint.send(
        m.Hello(
            worker_name=name,
            host=socket.gethostname(),
            pid=os.getpid(),
            device=",".join(devices),
            capabilities=list(REQUIRED_CAPABILITIES),
            host_id=host_identity(),
            role="producer",
        )
    )
    welcome = await_welcome(
        lambda timeout: endpoint.recv(timeout_s=timeout),
        address=endpoint.address,
        peer="coordinator",
        me="producer",
        error=AttachError,
        timeout_s=timeout_s,
        hint="Is the run's `dflash-pipe launch` running there, and is the address the one it printed "
        "(`producer at tcp://...`)?",
    )
    if not welcome.config:
        raise AttachError(
            f"{endpoint.address} answered as to a worker (no run config): it runs an older dflash-pipe"
        )
    return welcome


def attached_config(welcome: m.Welcome, layout: LayoutConfig, *, bind: str, keys: Path | None) -> RunConfig:
    """The run's config with this node's GPUs and this producer's own address for its workers; its run dir
    as the coordinator resolved it (the config may hold a path relative to the coordinator's directory)."""
    cfg = RunConfig.from_dict(welcome.config)
    cfg = dataclasses.replace(cfg, run_dir=Path(welcome.run_dir))
    if not cfg.run_dir.is_dir():
        raise AttachError(
            f"the run dir {cfg.run_dir} the coordinator writes is not visible on this node: put it on storage "
            "every node mounts at the same path (checkpoints and the drafters' state live there)"
        )
    return dataclasses.replace(cfg, layout=layout, wire=dataclasses.replace(cfg.wire, bind=bind, keys=keys))


def attached_context(cfg: RunConfig, welcome: m.Welcome, samples: LeasedSamples) -> RunContext:
    """A run context with no data of its own: the samples arrive in the coordinator's PLANs."""
    return RunContext(
        cfg=cfg,
        run_id=welcome.run_id,
        target_path=Path(welcome.target_path),
        tokenizer=None,
        data=LoadedData(samples=[], skipped_lines=0, truncated=0, dropped_short=0),
        train_samples=samples,
        eval_samples=[],
        drafter=DrafterConfig.from_dict(welcome.drafter),
        target_dtype=compute_dtype(cfg.layout.device),
        ledger=Ledger(welcome.num_samples, cfg.train.epochs),
        resume_from=Path(welcome.resume_from) if welcome.resume_from else None,
        resume_step=0,
        attached=True,
    )


def run_attached(
    address: str,
    layout: LayoutConfig,
    *,
    name: str,
    keys: Path | None,
    bind: str,
    join_timeout_s: float,
    console: Any,
    live: bool | None = None,
    on_address: Any = None,
) -> ProducerSummary:
    """Joins the run at ``address``, starts this node's workers (``layout``'s drafter devices) and serves
    them until the coordinator says DONE, every worker here leaves, or the coordinator is lost."""
    from dflash_pipe.producer.build import ProducerParts
    from dflash_pipe.producer.proc import ProducerProc, hard_exit
    from dflash_pipe.producer.target_threads import load_replicas
    from dflash_pipe.worker_pool import WorkerPool

    console.print(f"dflash-pipe producer {name}: joining the run at {address}", markup=False, highlight=False)
    if layout.device == "cpu":  # as a launch does: the target's threads and its workers' share the cores
        import torch

        torch.set_num_threads(threads_per_process(layout.num_workers + 1))
    endpoint = WorkerEndpoint(address, keys=keys)
    try:
        welcome = join(endpoint, name=name, devices=layout.target_devices(), timeout_s=join_timeout_s)
        cfg = attached_config(welcome, layout, bind=bind, keys=keys)
    except BaseException:
        endpoint.close(linger_s=0)
        raise
    upstream = Upstream(endpoint, welcome, name=name)
    ctx = attached_context(cfg, welcome, upstream.samples)
    loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-target-load")
    replicas = loader.submit(load_replicas, ctx)  # while the link keeps beating (ProducerProc.start_targets)
    loader.shutdown(wait=False)
    signals = Signals(
        stop_timeout_s=cfg.wire.stop_timeout_s, preempt=cfg.wire.preempt_signal, on_hard_stop=hard_exit
    )
    parts = ProducerParts(
        ctx,
        replicas=replicas,
        signals=signals,
        own_signals=True,
        console=console,
        live=live,
        upstream=upstream,
    )
    producer = ProducerProc(parts)
    upstream.serve_at(producer.address)
    pool = WorkerPool(cfg, producer.address, prefix=f"{name}-", logs=RunDir(cfg.run_dir).attached(name).logs)
    console.print(
        f"[bold]dflash-pipe[/] producer {name} attached to run {welcome.run_id} at {address}: target on "
        f"{', '.join(layout.target_devices())}, {layout.num_workers} drafter(s) on "
        f"{', '.join(layout.worker_devices())}, serving them at {producer.address}"
    )
    if on_address is not None:
        on_address(producer.address)
    try:
        pool.start()
        return producer.serve(watch=pool)
    finally:
        producer.close()
        pool.stop()
