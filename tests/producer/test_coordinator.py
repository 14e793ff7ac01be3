"""Producers that attach, message by message: the coordinator's side (admission, plans leased with the
samples' own tokens, a lost producer's plans computed again, link reports) and the attaching side's
``Upstream`` (credits asked for, plans turned into the samples its target reads, DONE passed on)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from test_core import LENGTHS, _compute_queued, _core, _hello

from dflash_pipe.producer.upstream import LeasedSamples, Upstream, plan_samples
from dflash_pipe.run.config import RunConfig
from dflash_pipe.wire import messages as m
from dflash_pipe.wire.codec import encode
from dflash_pipe.wire.errors import ProtocolError


def _producer_hello(name: str = "node1") -> m.Hello:
    return _hello(name, role="producer", host_id="other-node")


def test_a_producer_is_welcomed_with_the_runs_config_and_takes_no_worker_rank(tmp_path: Path) -> None:
    core, out, _ = _core(tmp_path)
    core.handle(b"p", _producer_hello())
    (welcome,) = out.of(b"p", m.Welcome)
    assert RunConfig.from_dict(welcome.config) == core.cfg
    assert welcome.rendezvous == "tcp://r:1"  # its workers join the run's one drafter group
    assert core.peers[b"p"].role == "producer" and not core.peers[b"p"].same_host
    core.handle(b"w", _hello("w"))
    assert core.peers[b"w"].rank == 0  # ranks count workers only
    assert out.of(b"w", m.Welcome)[0].config == {}
    core.handle(b"p2", msgspec.structs.replace(_producer_hello("node1"), pid=2))  # another process, same name
    assert "already in this run" in out.rejected[-1][1] and "producer" in out.rejected[-1][1]


def test_plans_carry_the_samples_tokens_and_a_lost_producers_plans_are_computed_again(tmp_path: Path) -> None:
    core, out, _ = _core(tmp_path)
    core.leases.targets_started(0)  # the coordinator's own replicas take one plan (ready_batches 1)
    samples = core.ctx.train_samples
    core.handle(b"p", _producer_hello())
    core.handle(b"w", _hello("w"))
    core.refill()
    assert core.leases.in_target == 1
    core.handle(b"p", m.Ready(credits=4))
    core.dispatch()
    plans = out.of(b"p", m.Plan)
    assert plans and core.leases.scheduler.next_plan() is None  # all but the local one went to the producer
    assert core.peers[b"p"].credits == 4 - len(plans) and core.leases.scheduler.leased_count() == len(plans)
    for plan in plans:
        ids = torch.cat([samples[i].input_ids for i in plan.sample_ids])
        mask = torch.cat([samples[i].loss_mask for i in plan.sample_ids])
        assert torch.equal(plan.tensors["input_ids"], ids)
        assert torch.equal(plan.tensors["loss_mask"].bool(), mask)
        assert plan.lengths == [LENGTHS[i] for i in plan.sample_ids]
    tokens = sum(sum(p.lengths) for p in plans)
    assert core.peers[b"p"].link_bytes == tokens * 8 + tokens  # int64 ids and a byte of mask a token

    core.peers[b"p"].last_heard = time.monotonic() - 60.0  # SIGKILLed: silent past peer_timeout_s
    core.watch_peers()
    assert core.peers[b"p"].state == "lost" and "producer node1" in core.peers.lost[0]
    assert not core.leases.scheduler.finished()
    trained: list[int] = []
    for step in range(1, 6):
        core.refill()  # the lost plan comes back to the coordinator's own replicas
        _compute_queued(core)
        core.take_ready()
        core.handle(b"w", m.Ready(credits=1))
        core.dispatch()
        batch = out.of(b"w", m.Batch)[-1]
        trained += batch.sample_ids
        core.handle(b"w", m.Ack(batch_ids=[batch.batch_id], step=step))
        if core.leases.scheduler.finished():
            break
    assert sorted(trained) == list(range(len(LENGTHS)))  # every sample once, none lost with the producer
    assert {p.batch_id for p in plans} <= {b.batch_id for b in out.of(b"w", m.Batch)}


def test_a_producers_acks_end_its_plans_and_its_link_report_joins_the_runs_totals(tmp_path: Path) -> None:
    core, out, metrics = _core(tmp_path)
    core.leases.targets_started(0)
    core.handle(b"p", _producer_hello())
    core.refill()
    core.handle(b"p", m.Ready(credits=1))
    core.dispatch()
    (plan,) = out.of(b"p", m.Plan)
    core.handle(b"p", m.Ack(batch_ids=[plan.batch_id], step=3))  # its worker trained it
    assert core.leases.scheduler.leased_count() == 0 and core.account.step == 3
    assert core.leases.scheduler.stats.acked_tokens == sum(LENGTHS[i] for i in plan.sample_ids)
    report = {"wire/feature_bytes_local": 1000.0, "wire/feature_bytes_remote": 0.0, "wire/plan_bytes": 0.0}
    core.handle(b"p", m.Metrics(step=3, values={**report, "tokens_per_s/producer": 50.0}))
    assert metrics.records[-1][0]["producer/node1/wire/feature_bytes_local"] == 1000.0
    from dflash_pipe.producer.coordinator import link_bytes

    totals = link_bytes(core)
    assert totals["wire/feature_bytes_local"] == 1000.0 and totals["wire/feature_bytes_remote"] == 0.0
    assert totals["tokens_per_s/attached_producers"] == 50.0 and totals["producers_attached"] == 1.0


def test_a_worker_of_another_node_counts_its_features_as_remote(tmp_path: Path) -> None:
    core, out, _ = _core(tmp_path)
    core.handle(b"far", _hello("far", host_id="other-node"))
    core.handle(b"near", _hello("near", host_id="h"))
    core.refill()
    _compute_queued(core)
    core.take_ready()
    for peer in (b"far", b"near"):
        core.handle(peer, m.Ready(credits=1))
    feats = torch.zeros(7, 4, dtype=torch.bfloat16)
    for batch in list(core.leases.scheduler._ready):
        batch.payload.tensors["features"] = feats
    core.dispatch()
    from dflash_pipe.producer.coordinator import link_bytes

    totals = link_bytes(core)
    assert totals["wire/feature_bytes_remote"] == feats.numel() * 2 == totals["wire/feature_bytes_local"]
    assert not any("over the network" in note for note in core.account.messages)  # no producer on its node
    core.handle(b"p", _producer_hello())  # host_id "other-node", as "far"
    core.handle(b"far2", _hello("far2", host_id="other-node"))
    assert any("far2 gets its features over the network" in n and "node1" in n for n in core.account.messages)


def test_plan_and_role_are_validated() -> None:
    with pytest.raises(ProtocolError, match="Hello.role"):  # types are checked as the sender encodes
        encode(_hello("x", role="coordinator"))
    with pytest.raises(ProtocolError, match="Plan.tensors.loss_mask"):
        m.Plan(batch_id=0, epoch=0, sample_ids=[1], lengths=[3], tensors={"input_ids": torch.arange(3)})
    with pytest.raises(ProtocolError, match="Plan.lengths"):
        m.Plan(batch_id=0, epoch=0, sample_ids=[1, 2], lengths=[3], tensors={})


class FakeEndpoint:
    address = "tcp://coordinator:1"

    def __init__(self) -> None:
        self.inbox: list[Any] = []
        self.sent: list[Any] = []

    def recv(self, timeout_s: float) -> Any:
        return self.inbox.pop(0) if self.inbox else None

    def send(self, msg: Any) -> None:
        self.sent.append(msg)

    def send_final(self, msg: Any) -> None:
        self.sent.append(msg)


def _upstream(tmp_path: Path) -> tuple[Upstream, FakeEndpoint, Any, Any]:
    core, out, _ = _core(tmp_path)
    welcome = m.Welcome(
        run_id="r", rendezvous="tcp://r:1", run_dir=str(tmp_path), target_path="t", drafter={}, train={},
        heartbeat_s=1.0, peer_timeout_s=5.0, num_samples=len(LENGTHS), credits=1, eval_batches=0,
    )  # fmt: skip
    endpoint = FakeEndpoint()
    up = Upstream(endpoint, welcome, name="node1")  # type: ignore[arg-type]
    core.leases.scheduler = type(core.leases.scheduler)(
        plan_epoch=core.leases.scheduler.plan_epoch, epochs=1, source=up.source()
    )
    return up, endpoint, core, out


def test_the_attaching_side_asks_for_plans_serves_them_and_passes_done_on(tmp_path: Path) -> None:
    up, endpoint, core, out = _upstream(tmp_path)
    core.leases.targets_started(0)  # the target still loads: no plan asked that no replica can compute
    up.pump(core)
    assert not endpoint.sent and up.requested == 0
    core.leases.targets_started(1)
    up.pump(core)
    (ready,) = [msg for msg in endpoint.sent if isinstance(msg, m.Ready)]
    assert ready.credits == core.cfg.wire.ready_batches + 2 * core.leases.target_threads  # 1 + 2
    ids = torch.tensor([5, 6, 7, 8, 9])
    endpoint.inbox.append(
        m.Plan(batch_id=11, epoch=0, sample_ids=[2, 0], lengths=[2, 3],
               tensors={"input_ids": ids, "loss_mask": torch.tensor([0, 1, 1, 1, 0], dtype=torch.uint8)})
    )  # fmt: skip
    up.pump(core)
    assert up.requested == 2 and not [msg for msg in endpoint.sent[1:] if isinstance(msg, m.Ready)]
    plan = core.leases.scheduler.next_plan()
    assert plan is not None and plan.batch_id == 11 and plan.sample_ids == [2, 0]
    assert torch.equal(up.samples[0].input_ids, ids[2:]) and up.samples[0].loss_mask.tolist() == [1, 1, 0]
    up.forward(m.Ack(batch_ids=[11], step=1))
    assert up.samples.held() == 0 and isinstance(endpoint.sent[-1], m.Ack)
    endpoint.inbox.append(m.Done(reason="all epochs trained"))
    up.pump(core)
    assert up.ended and core.leases.done_sent and core.leases.scheduler.next_plan() is None


def test_leased_samples_are_kept_until_their_last_batch_is_acked() -> None:
    held = LeasedSamples(num_samples=10)
    plan = m.Plan(
        batch_id=0, epoch=0, sample_ids=[4], lengths=[2],
        tensors={"input_ids": torch.tensor([1, 2]), "loss_mask": torch.tensor([1, 1], dtype=torch.uint8)},
    )  # fmt: skip
    held.hold(plan_samples(plan))
    held.hold(plan_samples(plan))  # the same sample in two epochs' batches at once
    held.drop([4])
    assert held[4].input_ids.tolist() == [1, 2] and len(held) == 10
    held.drop([4])
    with pytest.raises(KeyError):
        held[4]


def test_an_attaching_producer_takes_the_run_dir_the_coordinator_resolved(tmp_path: Path) -> None:
    from dflash_pipe.producer.attach import AttachError, attached_config
    from dflash_pipe.run.layout import LayoutConfig

    core, out, _ = _core(tmp_path)
    core.cfg = dataclasses.replace(core.cfg, run_dir=Path("runs/relative"))  # as `launch --run-dir runs/x`
    core.handle(b"p", _producer_hello())
    (welcome,) = out.of(b"p", m.Welcome)
    welcome = msgspec.structs.replace(welcome, run_dir=str(tmp_path))  # the coordinator's resolved path
    cfg = attached_config(
        welcome, LayoutConfig(device="cpu", cpu_workers=1), bind="tcp://127.0.0.1:0", keys=None
    )
    assert cfg.run_dir == tmp_path and cfg.layout.cpu_workers == 1 and cfg.wire.bind == "tcp://127.0.0.1:0"
    missing = msgspec.structs.replace(welcome, run_dir=str(tmp_path / "not-mounted"))
    with pytest.raises(AttachError, match="not visible on this node"):
        attached_config(missing, LayoutConfig(device="cpu"), bind="tcp://127.0.0.1:0", keys=None)
