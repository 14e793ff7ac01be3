"""The drafter worker process: handshake with the producer, build the drafter, train, leave cleanly.

``run_worker`` is what ``dflash-pipe worker`` (and the launcher, once per drafter GPU) runs. Anything that
goes wrong is reported to the producer as an ERROR message before the process exits: never swallowed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from dflash_pipe.compute.compile import apply_dynamo_settings
from dflash_pipe.compute.precision import compute_dtype
from dflash_pipe.config.train import TrainConfig
from dflash_pipe.diskspace import DiskFullError
from dflash_pipe.drafter import DFlashDrafter, DrafterConfig, load_frozen_target_parts
from dflash_pipe.drafter.checkpointing import CheckpointPolicy
from dflash_pipe.run.checkpoint import load_checkpoint
from dflash_pipe.run.dir import RunDir
from dflash_pipe.run.ledger import Ledger
from dflash_pipe.run.signals import Signals, StopNow
from dflash_pipe.train.batches import unpack
from dflash_pipe.train.build import build_drafter
from dflash_pipe.train.compile_check import warm_up_checked
from dflash_pipe.train.distributed import DrafterGroup, GpuTakenError, GroupBrokenError, RendezvousLostError
from dflash_pipe.train.optim import build_optimizer
from dflash_pipe.train.real_eval import RealEval
from dflash_pipe.wire import messages as m
from dflash_pipe.wire.ring import SlotRing
from dflash_pipe.wire.welcome import Redirected
from dflash_pipe.worker.join import HandshakeError, ProducerLost, RedirectUnanswered, follow, handshake
from dflash_pipe.worker.link import ProducerLink, ready_paths
from dflash_pipe.worker.loop import WorkerSession, checkpoint, evaluate, regroup, run_training
from dflash_pipe.worker.threads import ThreadedReplicas


def run_worker(
    connect: str,
    *,
    device: str,
    name: str,
    join_timeout_s: float,
    reconnect_timeout_s: float,
    stop_timeout_s: float,
    started_at: float | None = None,
    keys: Path | None = None,
    redirect: bool = True,
) -> int:
    """Serves one producer; if it dies, keeps trying the same address for ``reconnect_timeout_s`` and
    joins the resumed run (``dflash-pipe launch --resume``) from its latest checkpoint. The timeouts have
    their defaults in one place, the ``worker`` command's options. ``redirect``: follow the coordinator's
    REDIRECT to the producer of this node (``worker.join``); False is ``worker --no-redirect``.

    SIGINT/SIGTERM: while training, finish the step, return the leases, leave the group (the last worker to
    leave checkpoints) within ``stop_timeout_s``, else exit hard; before training (connecting, warming up,
    waiting for a producer) leave at once. A second one exits at once."""
    started_at = started_at or time.time()
    signals = Signals(stop_timeout_s=stop_timeout_s, on_hard_stop=_hard_exit(name)).install()
    print(f"dflash-pipe worker {name}: connecting to {connect} ({device})", file=sys.stderr, flush=True)
    try:
        return _serve_until_done(
            connect,
            device=device,
            name=name,
            join_timeout_s=join_timeout_s,
            reconnect_timeout_s=reconnect_timeout_s,
            started_at=started_at,
            keys=keys,
            signals=signals,
            redirect=redirect,
        )
    except StopNow as exc:
        print(f"dflash-pipe worker {name}: stopped by {exc} before training", file=sys.stderr, flush=True)
        return 0
    finally:
        signals.restore()


def _serve_until_done(
    connect: str,
    *,
    device: str,
    name: str,
    join_timeout_s: float,
    reconnect_timeout_s: float,
    started_at: float,
    keys: Path | None,
    signals: Signals,
    redirect: bool,
) -> int:
    """``_serve`` again after a lost producer, until it comes back or ``reconnect_timeout_s`` has passed.
    Each session starts at ``connect`` (``follow``: the coordinator may send it to its node's producer
    again, or welcome it itself once that producer is gone)."""
    leave = signals.stop
    deadline: float | None = None
    serve = functools.partial(
        _serve, device=device, name=name, started_at=started_at, keys=keys, signals=signals
    )

    def say(line: str) -> None:
        print(f"dflash-pipe worker {name}: {line}", file=sys.stderr, flush=True)

    while True:
        timeout_s = join_timeout_s if deadline is None else max(1.0, deadline - time.monotonic())
        try:
            return follow(serve, connect, redirect=redirect, timeout_s=timeout_s, say=say)
        except ProducerLost as lost:
            if leave.is_set() or reconnect_timeout_s <= 0:
                print(f"dflash-pipe worker {name}: {lost}; exiting.", file=sys.stderr, flush=True)
                return 3
            if deadline is not None and not lost.welcomed and time.monotonic() >= deadline:
                print(
                    f"dflash-pipe worker {name}: no producer came back at {connect} within "
                    f"{reconnect_timeout_s:.0f} s (--reconnect-timeout); giving up. Resume the run with "
                    "`dflash-pipe launch --resume RUN_DIR`, then attach workers again.",
                    file=sys.stderr,
                    flush=True,
                )
                return 3
            if lost.welcomed or deadline is None:
                deadline = time.monotonic() + reconnect_timeout_s
            print(
                f"dflash-pipe worker {name}: {lost}. Reconnecting to {connect} for up to "
                f"{reconnect_timeout_s:.0f} s (--reconnect-timeout). If the run's coordinator is gone too, "
                "resume it with `dflash-pipe launch --resume RUN_DIR` (a lost attached producer needs nothing: "
                "the coordinator takes this worker back).",
                file=sys.stderr,
                flush=True,
            )


def _serve(
    connect: str,
    *,
    redirect: bool,
    timeout_s: float,
    unanswered: type[HandshakeError],
    device: str,
    name: str,
    started_at: float,
    keys: Path | None,
    signals: Signals,
) -> int:
    """One session with one producer: handshake, build, join the group, train, leave cleanly. Its REDIRECT
    (``Redirected``) and silence after one (``unanswered``) go up to ``follow``."""
    leave = signals.stop
    try:
        link = ProducerLink(connect, keys=keys)
    except ValueError as exc:  # bad address or key directory: one line naming the fix
        print(f"dflash-pipe worker: {exc}", file=sys.stderr)
        return 2
    group: DrafterGroup | None = None
    welcome: m.Welcome | None = None
    ring: SlotRing | None = None
    replicas: ThreadedReplicas | None = None
    try:
        welcome = handshake(
            link, name=name, device=device, timeout_s=timeout_s, redirect=redirect, unanswered=unanswered
        )
        link.heartbeat_s = welcome.heartbeat_s
        link.peer_timeout_s = welcome.peer_timeout_s
        devs = [torch.device(d) for d in device.split(",")]
        dev = devs[0]
        ring = link.map_ring(welcome, dev)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        drafter_cfg = DrafterConfig.from_dict(welcome.drafter)
        train_cfg = TrainConfig.from_dict(welcome.train)
        models, warm = _build_replicas(welcome, drafter_cfg, train_cfg, devs)
        model = models[0]
        optimizer = build_optimizer(model.trainable_parameters(), train_cfg)
        ledger = Ledger(welcome.num_samples, train_cfg.epochs)
        step = 0
        if welcome.resume_from and Path(welcome.resume_from).exists():
            state = load_checkpoint(Path(welcome.resume_from), model=model, optimizer=optimizer)
            step, ledger = state.step, Ledger.from_dict(state.ledger).with_epochs(train_cfg.epochs)
        if len(devs) > 1:
            replicas = ThreadedReplicas(models, devs)
            print(
                f"dflash-pipe worker {name}: {len(devs)} drafter threads on {', '.join(map(str, devs))}",
                file=sys.stderr,
                flush=True,
            )
        # Join the group only once warm: members never wait in a collective for someone compiling.
        group = DrafterGroup(
            welcome.rendezvous,
            run_id=welcome.run_id,
            device=dev,
            timeout_s=welcome.peer_timeout_s,
            join_timeout_s=timeout_s,
            name=name,
        )
        session = WorkerSession(
            link=link,
            group=group,
            model=model,
            optimizer=optimizer,
            ledger=ledger,
            train=train_cfg,
            drafter_config=welcome.drafter,
            run_dir=Path(welcome.run_dir),
            device=dev,
            step=step,
            started_at=started_at,
            block_size=drafter_cfg.block_size,
            feature_size=drafter_cfg.feature_size,
            replicas=replicas,
            eval_pending=welcome.eval_pending,
            target_path=welcome.target_path,
        )
        if warm:
            link.send(m.Metrics(step=step, values=warm))
        _receive_eval_set(session, welcome)
        if train_cfg.eval_generate != "off" and session.eval_batches:
            session.real_eval = RealEval(welcome.target_path, session.eval_batches, train_cfg, dev)
        regroup(session, "joining")
        link.send(m.Ready(credits=welcome.credits * len(devs), **ready_paths(ring)))
        signals.drainable = True  # from here a stop signal finishes the step instead of unwinding
        session.saved_step = step if welcome.resume_from else None
        result = run_training(session, leave.is_set)
        if result.left:
            link.send_and_flush(m.Bye(reason=f"{name} left ({signals.stop_name or 'interrupted'})"))
            return 0
        if session.saved_step != session.step:
            checkpoint(session)
        if session.rank == 0 and session.final_eval and not leave.is_set():
            link.send(m.Metrics(step=session.step, values={**evaluate(session, final=True), "final": 1.0}))
        with contextlib.suppress(GroupBrokenError):  # a member dying now changes nothing: we stop
            group.barrier()
        link.send_and_flush(m.Bye(reason=result.stop_reason))
        return 0
    except StopNow as exc:  # a signal before training: nothing to drain, the producer hears BYE
        link.send_and_flush(m.Bye(reason=f"{name} stopped by {exc} before training"))
        raise
    except (Redirected, RedirectUnanswered):  # never joined here: ``follow`` goes on (the link closes below)
        raise
    except BaseException as exc:  # report every failure to the producer, then exit non-zero
        if link.refused is not None:  # wrong or missing CURVE keys: the fix is here, retrying cannot help
            print(f"dflash-pipe worker {name}: {link.refused}", file=sys.stderr, flush=True)
            return 2
        if link.lost_reason is not None or isinstance(exc, RendezvousLostError):
            reason = link.lost_reason or f"the producer at {connect} is gone ({exc})"
            raise ProducerLost(reason, welcomed=welcome is not None) from None
        message = f"{type(exc).__name__}: {exc}"
        whole = isinstance(
            exc, (HandshakeError, KeyboardInterrupt, DiskFullError, GpuTakenError)
        )  # the line says it all
        trace = "" if whole else traceback.format_exc()
        link.send_and_flush(m.Error(source=name, message=message, traceback=trace))
        print(f"dflash-pipe worker {name}: {message}", file=sys.stderr, flush=True)
        if not whole:
            traceback.print_exc()
        return 2 if isinstance(exc, HandshakeError) else 1
    finally:
        signals.drainable = False
        if replicas is not None:
            replicas.close()
        link.close()
        if ring is not None:
            ring.close()
        if group is not None:
            group.close()


def _build_replicas(
    welcome: m.Welcome, drafter_cfg: DrafterConfig, train_cfg: TrainConfig, devices: list[torch.device]
) -> tuple[list[DFlashDrafter], dict[str, float]]:
    """One drafter per device (several: threaded mode), built by ``train.build`` and each warmed in turn
    before any thread starts (with ``train.compile=full``, checked and if need be re-applied with less)."""
    threaded = len(devices) > 1
    policy = CheckpointPolicy(train_cfg.activation_checkpointing, mode="threaded" if threaded else "process")
    apply_dynamo_settings()
    models, warm, parts = [], {}, {}
    for dev in devices:
        feature_dtype = compute_dtype(dev)
        if str(dev) not in parts:  # the frozen embedding and head are read-only: one copy per device
            parts[str(dev)] = load_frozen_target_parts(welcome.target_path, dtype=feature_dtype, device=dev)
        embed, head = parts[str(dev)]
        model, compile_on = build_drafter(drafter_cfg, train_cfg, embed, head, dev, checkpointing=policy)
        if compile_on:
            cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", RunDir(welcome.run_dir).compile_cache)
            warm = warm_up_checked(  # full: then checked against eager, falling back to attention
                model,
                full=train_cfg.compile_plan(dev.type) == "full",
                drafter_config=welcome.drafter,
                cache_dir=Path(cache),
                device=dev,
                seq_len=min(1024, drafter_cfg.max_position_embeddings),
                once=train_cfg.compile_warmup == "once",
            )
        models.append(model)
    return models, warm


def _receive_eval_set(s: WorkerSession, welcome: m.Welcome) -> None:
    """Every worker gets the held-out eval batches right after WELCOME (any of them may become rank 0)."""
    if welcome.eval_batches == 0:
        return
    deadline = time.monotonic() + welcome.peer_timeout_s
    while len(s.eval_batches) < welcome.eval_batches:
        msg = s.link.get(timeout_s=1.0)
        if isinstance(msg, m.Batch) and msg.for_eval:
            s.eval_batches.append(unpack(msg.tensors, msg.lengths, s.device, feature_size=s.feature_size))
        elif msg is not None:
            raise HandshakeError(f"expected the eval set from the producer, got {type(msg).__name__}")
        if time.monotonic() > deadline:
            raise HandshakeError("the producer did not send the eval set in time")


def _hard_exit(name: str):
    """The worker's hard stop: one line saying why, then exit (a checkpoint on disk is whole or absent)."""

    def stop(reason: str, code: int) -> None:
        sys.stderr.write(f"dflash-pipe worker {name}: {reason}; exiting now\n")
        sys.stderr.flush()
        os._exit(code)

    return stop
