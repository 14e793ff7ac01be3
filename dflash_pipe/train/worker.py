"""The drafter worker process: handshake with the producer, build the drafter, train, leave cleanly.

``run_worker`` is what ``dflash-pipe worker`` (and the launcher, once per drafter GPU) runs. Anything that
goes wrong is reported to the producer as an ERROR message before the process exits: never swallowed.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from dflash_pipe.drafter import DFlashDrafter, DrafterConfig, load_frozen_target_parts
from dflash_pipe.train.batches import unpack
from dflash_pipe.train.checkpoint import load_checkpoint
from dflash_pipe.train.config import TrainConfig
from dflash_pipe.train.distributed import DrafterGroup
from dflash_pipe.train.ledger import Ledger
from dflash_pipe.train.link import ProducerLink
from dflash_pipe.train.loop import WorkerSession, checkpoint, evaluate, run_training
from dflash_pipe.train.optim import build_optimizer
from dflash_pipe.train.warmup import warm_up
from dflash_pipe.wire import messages as m

CAPABILITIES = ["frames"]


class HandshakeError(RuntimeError):
    """The producer refused this worker or never answered."""


def run_worker(
    connect: str, *, device: str, name: str, join_timeout_s: float = 900.0, started_at: float | None = None
) -> int:
    started_at = started_at or time.time()
    stop = threading.Event()
    _install_signal_handlers(stop)
    link = ProducerLink(connect, on_lost=_die_if_stuck)
    group: DrafterGroup | None = None
    try:
        welcome = _handshake(link, name=name, device=device, timeout_s=join_timeout_s)
        link.heartbeat_s = welcome.heartbeat_s
        link.peer_timeout_s = welcome.peer_timeout_s
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        drafter_cfg = DrafterConfig.from_dict(welcome.drafter)
        train_cfg = TrainConfig(**welcome.train)
        feature_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        embed, head = load_frozen_target_parts(welcome.target_path, dtype=feature_dtype, device=dev)
        compile_on = train_cfg.compile == "on" or (train_cfg.compile == "auto" and dev.type == "cuda")
        model = DFlashDrafter(drafter_cfg, embed, head, compile_attention=compile_on).to(dev)
        model.train()
        optimizer = build_optimizer(model.trainable_parameters(), train_cfg)
        group = DrafterGroup(
            welcome.rendezvous,
            rank=welcome.rank,
            world_size=welcome.world_size,
            device=dev,
            timeout_s=welcome.peer_timeout_s,
        )
        ledger = Ledger(welcome.num_samples, train_cfg.epochs)
        step = 0
        if welcome.resume_from:
            state = load_checkpoint(Path(welcome.resume_from), model=model, optimizer=optimizer)
            step, ledger = state.step, Ledger.from_dict(state.ledger)
        warm = {}
        if compile_on:
            warm = warm_up(
                model,
                drafter_config=welcome.drafter,
                cache_dir=Path(
                    os.environ.get("TORCHINDUCTOR_CACHE_DIR", Path(welcome.run_dir) / "compile-cache")
                ),
                device=dev,
                seq_len=min(1024, drafter_cfg.max_position_embeddings),
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
            rank=welcome.rank,
            step=step,
            started_at=started_at,
            block_size=drafter_cfg.block_size,
            feature_size=drafter_cfg.feature_size,
        )
        if warm:
            link.send(m.Metrics(step=step, values=warm))
        _receive_eval_set(session, welcome)
        link.send(m.Ready(credits=welcome.credits))
        result = run_training(session, stop.is_set)
        if result.last_checkpoint is None or session.step % train_cfg.checkpoint_every:
            checkpoint(session)
        if session.rank == 0:
            link.send(m.Metrics(step=session.step, values={**evaluate(session), "final": 1.0}))
        group.barrier()
        link.send_and_flush(m.Bye(reason=result.stop_reason))
        return 0
    except BaseException as exc:  # report every failure to the producer, then exit non-zero
        message = f"{type(exc).__name__}: {exc}"
        link.send_and_flush(m.Error(source=name, message=message, traceback=traceback.format_exc()))
        print(f"dflash-pipe worker {name}: {message}", file=sys.stderr)
        if not isinstance(exc, (HandshakeError, KeyboardInterrupt)):
            traceback.print_exc()
        return 2 if isinstance(exc, HandshakeError) else 1
    finally:
        link.close()
        if group is not None:
            group.close()


def _handshake(link: ProducerLink, *, name: str, device: str, timeout_s: float) -> m.Welcome:
    link.send(
        m.Hello(
            protocol_version=m.PROTOCOL_VERSION,
            worker_name=name,
            host=socket.gethostname(),
            pid=os.getpid(),
            device=device,
            capabilities=CAPABILITIES,
        )
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = link.get(timeout_s=1.0)
        if isinstance(msg, m.Welcome):
            return msg
        if isinstance(msg, m.Reject):
            raise HandshakeError(f"the producer at {link.address} refused this worker: {msg.reason}")
        if isinstance(msg, m.Error):
            raise HandshakeError(f"the producer at {link.address} failed: {msg.message}")
    raise HandshakeError(
        f"no WELCOME from {link.address} within {timeout_s:.0f} s. Is `dflash-pipe launch` running there, "
        "and is the address (host and port) the one it printed?"
    )


def _receive_eval_set(s: WorkerSession, welcome: m.Welcome) -> None:
    """Rank 0 gets the held-out eval batches right after WELCOME, before any training batch."""
    if s.rank != 0 or welcome.eval_batches == 0:
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


def _install_signal_handlers(stop: threading.Event) -> None:
    """Ctrl-C / SIGTERM: finish the current step, checkpoint, leave. A second one exits at once."""

    def handler(signum: int, _frame: object) -> None:
        if stop.is_set():
            os._exit(130)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)


def _die_if_stuck(reason: str) -> None:
    """Called from the link thread when the producer is gone: the training thread may be blocked in a
    collective that will never finish, so leave the process with a clear message instead of hanging."""
    print(
        f"dflash-pipe worker: {reason}; exiting. Restart with `dflash-pipe launch --resume RUN_DIR`.",
        file=sys.stderr,
    )
    sys.stderr.flush()
    os._exit(3)
