"""Threaded mode trains exactly like process mode: 2 drafter threads in one member == 2 member processes.

Both run the real ``run_training`` and ``DrafterGroup`` (gloo, elastic rendezvous on a local TCPStore) on the
same batches, fed over the real wire (a ``ProducerLink`` to an in-process producer endpoint on ipc://). The
threaded member's layers are torch.compile'd (SDPA path) through the compile guard, on a fresh inductor
cache; the process members run eager.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dflash_pipe.config.train import TrainConfig
from dflash_pipe.drafter import DFlashDrafter
from dflash_pipe.drafter.checkpointing import CheckpointPolicy
from dflash_pipe.drafter.compile_guard import GUARD
from dflash_pipe.run.ledger import Ledger
from dflash_pipe.train.build import apply_checkpointing, apply_compile
from dflash_pipe.train.distributed import DrafterGroup
from dflash_pipe.train.optim import build_optimizer
from dflash_pipe.wire import messages as m
from dflash_pipe.worker.loop import WorkerSession, regroup, run_training
from dflash_pipe.worker.threads import ThreadedReplicas
from tests.drafter.conftest import tiny_config
from tests.worker.loopback import LoopbackProducer

pytestmark = pytest.mark.slow  # a cold compile and three gloo members: minutes on 2 cores

NUM_BATCHES = 6
WIDTH = 2


def make_batches() -> list[m.Batch]:
    gen = torch.Generator().manual_seed(0)
    batches = []
    for b in range(NUM_BATCHES):
        # Two samples in every batch, lengths varying: one batch size, so the cold compile makes the
        # variants of one shape family (grad / no grad) and not those of B=1 too (sizes 1 specialise).
        lengths = [20 + 3 * b, 12 + b]
        total = sum(lengths)
        tensors = {
            "input_ids": torch.randint(0, 49, (total,), generator=gen),
            "loss_mask": torch.ones(total, dtype=torch.bool),
            "features": torch.randn(total, 2 * 32, generator=gen),
        }
        batches.append(
            m.Batch(
                batch_id=b,
                epoch=0,
                sample_ids=list(range(3 * b, 3 * b + len(lengths))),
                lengths=lengths,
                tensors=tensors,
            )
        )
    return batches


def make_drafter(*, compile_layers: bool, mode: str) -> DFlashDrafter:
    cfg = tiny_config(attention_backend="sdpa")
    torch.manual_seed(1)
    embed, head = (
        nn.Embedding(cfg.vocab_size, cfg.hidden_size),
        nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False),
    )
    model = DFlashDrafter(cfg, embed, head)
    apply_checkpointing(model, CheckpointPolicy("layers", mode=mode))
    apply_compile(model, attention=False, layers=compile_layers)
    torch.manual_seed(2)
    model.reset_parameters()  # same weights in every member and replica
    return model


def train(
    port: int, models: list[DFlashDrafter], run_dir: Path, pick: slice | None
) -> tuple[list[float], float]:
    """One group member; ``pick`` selects this member's batches by its rank (process mode), None = all."""
    devices = [torch.device("cpu")] * len(models)
    group = DrafterGroup(
        f"tcp://127.0.0.1:{port}", run_id="t", device=devices[0], timeout_s=60, join_timeout_s=120
    )
    replicas = ThreadedReplicas(models, devices) if len(models) > 1 else None
    producer = LoopbackProducer()
    try:
        train_cfg = TrainConfig(lr=1e-2, warmup_ratio=0.0, log_every=1, checkpoint_every=1000, epochs=1)
        s = WorkerSession(
            link=producer.link,
            group=group,
            model=models[0],
            optimizer=build_optimizer(models[0].trainable_parameters(), train_cfg),
            ledger=Ledger(3 * NUM_BATCHES, 1),
            train=train_cfg,
            drafter_config=tiny_config().to_dict(),
            run_dir=run_dir,
            device=devices[0],
            block_size=4,
            feature_size=64,
            replicas=replicas,
        )
        regroup(s, "joining")
        batches = make_batches()
        producer.offer(batches if pick is None else batches[s.rank :: group.world_size])
        result = run_training(s, lambda: False)
        assert result.stop_reason == "all acked", result
        producer.finish()
        checksum = float(sum(p.detach().double().sum() for p in s.params))
        return producer.losses() if s.rank == 0 else [], checksum
    finally:
        producer.close()
        if replicas is not None:
            replicas.close()
        group.close()


def _process_member(port: int, run_dir: str, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    model = make_drafter(compile_layers=False, mode="process")
    # Both members reach the rendezvous together: it closes LAST_CALL_S after its first arrival, and a member
    # still importing torch on a loaded machine would miss it, leaving a group of one that trains every
    # batch (six losses, not three).
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    store.add("test_members_arrived", 1)
    while store.add("test_members_arrived", 0) < WIDTH:
        time.sleep(0.05)
    out.put(train(port, [model], Path(run_dir), pick=slice(None)))


def test_threads_match_processes(tmp_path: Path, monkeypatch):
    """About a minute in a full suite: two spawned member processes (each importing torch) train eagerly, then
    two threads train with their layers compiled by Inductor on a cold cache. The claim is that both modes
    give the same losses and weights from a real cold compile, so neither side can be a stand-in."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a cold compile
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [ctx.Process(target=_process_member, args=(store.port, str(tmp_path), out)) for _ in range(WIDTH)]
    for p in procs:
        p.start()
    results = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    process_losses = next(r[0] for r in results if r[0])
    assert results[0][1] == results[1][1]  # the two process members hold the same weights

    threaded_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    models = [make_drafter(compile_layers=True, mode="threaded") for _ in range(WIDTH)]
    torch._dynamo.reset()  # nothing compiled by tests that ran before in this process
    before = GUARD.exclusive_runs
    thread_losses, thread_checksum = train(threaded_store.port, models, tmp_path, pick=None)

    assert len(thread_losses) == NUM_BATCHES // WIDTH == len(process_losses)
    torch.testing.assert_close(thread_losses, process_losses, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(thread_checksum, results[0][1], rtol=1e-4, atol=1e-4)
    # Nothing was warmed: the first step of each thread compiled, alone.
    assert GUARD.exclusive_runs > before
    for p0, p1 in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p0, p1)  # replicas stay identical after every step
