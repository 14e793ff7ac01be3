"""The producer's core without a socket: admission, credits, leases, a lost worker's redelivery, accounting.

The outbox is a list and the "target thread" is this test, which turns each queued plan into a ready
batch; so every decision of ``ProducerCore`` is checked message by message.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from dflash_pipe.config.train import TrainConfig
from dflash_pipe.data import DataConfig, Sample
from dflash_pipe.producer.core import ProducerCore
from dflash_pipe.producer.display import summary
from dflash_pipe.producer.rings import Rings
from dflash_pipe.producer.scheduler import PlannedBatch, ReadyBatch
from dflash_pipe.producer.setup import RunContext
from dflash_pipe.run.config import RunConfig, WireConfig
from dflash_pipe.run.layout import LayoutConfig
from dflash_pipe.run.ledger import Ledger
from dflash_pipe.wire import messages as m

LENGTHS = [5, 6, 7, 8]


class Outbox:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Any]] = []
        self.rejected: list[tuple[bytes, str]] = []
        self.redirected: list[tuple[bytes, m.Redirect]] = []

    def send(self, peer_id: bytes, msg: Any, *, ring: Any = None) -> None:
        self.sent.append((peer_id, msg))

    def reject(self, peer_id: bytes, reason: str) -> None:
        self.rejected.append((peer_id, reason))

    def redirect(self, peer_id: bytes, msg: m.Redirect) -> None:
        self.redirected.append((peer_id, msg))

    def of(self, peer_id: bytes, kind: type) -> list[Any]:
        return [msg for who, msg in self.sent if who == peer_id and isinstance(msg, kind)]


class Metrics:
    def __init__(self) -> None:
        self.records: list[tuple[dict, int]] = []

    def log(self, values: dict, step: int) -> None:
        self.records.append((dict(values), step))


def _core(tmp_path: Path) -> tuple[ProducerCore, Outbox, Metrics]:
    cfg = RunConfig(
        run_dir=tmp_path,
        data=DataConfig(path=tmp_path / "d.jsonl", token_budget=13),  # two samples a batch
        train=TrainConfig(epochs=1, seed=0),
        wire=WireConfig(ready_batches=1, worker_credits=1, heartbeat_s=1.0, peer_timeout_s=5.0),
        layout=LayoutConfig(device="cpu", cpu_workers=2),
    )
    samples = [Sample(i, torch.arange(n), torch.ones(n, dtype=torch.bool)) for i, n in enumerate(LENGTHS)]
    ctx = RunContext(
        cfg=cfg,
        run_id="run-1",
        target_path=tmp_path / "target",
        tokenizer=None,
        data=None,  # type: ignore[arg-type]
        train_samples=samples,
        eval_samples=[],
        drafter=SimpleNamespace(to_dict=lambda: {"hidden_size": 8}),  # type: ignore[arg-type]
        target_dtype=torch.float32,
        ledger=Ledger(len(samples), 1),
        resume_from=None,
        resume_step=0,
    )
    out, metrics = Outbox(), Metrics()
    core = ProducerCore(
        ctx, out=out, metrics=metrics, rings=Rings(cuda=None, shm=None), host_id="h", rendezvous="tcp://r:1"
    )
    core.leases.targets_started(1)
    return core, out, metrics


def _compute_queued(core: ProducerCore) -> None:
    """What a target thread does: every queued plan becomes a ready batch."""
    while not core.leases.plans.empty():
        plan = core.leases.plans.get_nowait()
        assert isinstance(plan, PlannedBatch)
        lengths = [LENGTHS[i] for i in plan.sample_ids]
        ids = torch.cat([torch.arange(n) for n in lengths])
        payload = m.Batch(
            batch_id=plan.batch_id,
            epoch=plan.epoch,
            sample_ids=plan.sample_ids,
            lengths=lengths,
            tensors={"input_ids": ids},
        )
        core.leases.ready.put(ReadyBatch(plan=plan, payload=payload, tokens=sum(lengths)))


def _hello(name: str, **kw: Any) -> m.Hello:
    return m.Hello(worker_name=name, host="h", pid=1, device="cpu", capabilities=["frames"], **kw)


def test_admission_answers_welcome_with_the_run_or_reject_naming_why(tmp_path: Path) -> None:
    core, out, _ = _core(tmp_path)
    core.handle(b"a", m.Ack(batch_ids=[0], step=1))
    assert out.rejected == [(b"a", "say HELLO first")]
    core.handle(b"old", _hello("old", protocol_version=m.PROTOCOL_VERSION - 1))
    assert "protocol" in out.rejected[-1][1] and b"old" not in core.peers
    core.handle(b"a", _hello("a"))
    (welcome,) = out.of(b"a", m.Welcome)
    assert welcome.run_id == "run-1" and welcome.rendezvous == "tcp://r:1"
    assert welcome.num_samples == len(LENGTHS) and welcome.credits == 1 and welcome.eval_batches == 0
    assert TrainConfig.from_dict(welcome.train) == core.cfg.train  # typed at both ends
    assert welcome.ring == {} and welcome.cuda_ring == {}  # no rings held: frames only
    core.handle(b"a", _hello("a"))
    assert isinstance(out.sent[-1][1], m.Reject) and out.sent[-1][1].reason == "already joined"


def test_a_lost_workers_lease_goes_to_the_other_and_every_sample_is_trained_once(tmp_path: Path) -> None:
    core, out, metrics = _core(tmp_path)
    for peer in (b"a", b"b"):
        core.handle(peer, _hello(peer.decode()))
    core.refill()
    assert core.leases.in_target == 3  # ready_batches 1 + 2 per target thread
    _compute_queued(core)
    core.take_ready()
    core.handle(b"a", m.Ready(credits=1))
    core.dispatch()
    (first,) = out.of(b"a", m.Batch)
    assert core.leases.scheduler.leased_count() == 1 and core.peers[b"a"].credits == 0

    core.peers[b"a"].last_heard = time.monotonic() - 60.0  # silent past peer_timeout_s
    core.watch_peers()
    assert core.peers[b"a"].state == "lost" and core.leases.scheduler.leased_count() == 0
    assert "silent" in core.peers.lost[0] and metrics.records[-1][0]["workers_lost"] == 1.0

    trained: list[int] = []
    for step in range(1, 10):
        core.handle(b"b", m.Ready(credits=1))
        core.refill()
        _compute_queued(core)
        core.take_ready()
        core.dispatch()
        batch = out.of(b"b", m.Batch)[-1]
        if step == 1:
            assert batch.batch_id == first.batch_id  # redelivered first
        trained += batch.sample_ids
        core.handle(b"b", m.Ack(batch_ids=[batch.batch_id], step=step))
        if core.leases.scheduler.finished():
            break
    assert sorted(trained) == list(range(len(LENGTHS)))
    result = summary(core, stop_reason="finished", wall_s=1.0, busy={})
    assert result.acked_tokens == sum(LENGTHS) and result.duplicates_redelivered == 1
    assert result.steps == step and core.peers[b"b"].steps == step


def test_a_worker_that_fell_back_from_the_full_compile_is_named(tmp_path: Path) -> None:
    """train.compile=full's warm-up check failed in one worker: the producer's notes say which, and the
    metrics keep the figures."""
    core, _, metrics = _core(tmp_path)
    core.handle(b"a", _hello("a"))
    core.handle(b"a", m.Metrics(step=0, values={"warmup_s": 3.0, "compile_fallback": 0.0}))
    assert not any("compile" in note for note in core.account.messages)
    core.handle(b"b", _hello("b"))
    core.handle(b"b", m.Metrics(step=0, values={"warmup_s": 3.0, "compile_fallback": 1.0}))
    assert any("worker b" in note and "--compile attention" in note for note in core.account.messages)
    assert metrics.records[-1][0]["compile_fallback"] == 1.0
