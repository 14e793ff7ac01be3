"""The coordinator's side of producers that attach: admit them, lease them plans, count what crosses links.

The first producer of a run is its coordinator: it owns the epoch's plan, the ledger's view, the
regenerated replies and the checkpoints. A producer on another node (``dflash-pipe producer --connect``)
says HELLO with role "producer" and gets a WELCOME carrying the run's whole config; from then on it asks
for plans with READY credits like a worker asks for batches, gets PLANs (the samples' tokens, ~9 bytes a
token) and computes their features on its own target for the workers of its own node, so features never
cross nodes. Its workers' ACKs come back through it and end the plan's lease here; when it is lost
(silent, disconnected, SIGKILLed) ``BatchScheduler.release`` puts its open plans back for any replica.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from dflash_pipe.producer.handshake import refusal, welcome
from dflash_pipe.producer.peers import Peer
from dflash_pipe.wire import messages as m

if TYPE_CHECKING:
    from dflash_pipe.producer.parts import CoreParts


def admit_producer(core: CoreParts, peer_id: bytes, msg: m.Hello) -> Peer | None:
    """WELCOME with the run's config and the held-out set's PLANs, or REJECT naming why."""
    if (why := refusal(core, msg)) is not None:
        core.out.reject(peer_id, why)
        return None
    peer = core.peers.add(Peer.from_hello(peer_id, msg, here=core.host_id))
    eval_batches = core.leases.eval_batches
    hello = msgspec.structs.replace(welcome(core, peer, len(eval_batches)), config=core.cfg.to_dict())
    core.out.send(peer_id, hello)
    for batch in eval_batches:
        if peer.left:
            break
        send_plan(core, peer, eval_plan(batch))
    core.note(f"producer {peer.name} ({peer.device} on {peer.host}) attached at step {core.account.step}")
    return peer


def eval_plan(batch: m.Batch) -> m.Plan:
    """A held-out BATCH without its features: the attaching producer computes them on its own target."""
    return m.Plan(
        batch_id=batch.batch_id,
        epoch=batch.epoch,
        sample_ids=batch.sample_ids,
        lengths=batch.lengths,
        tensors={"input_ids": batch.tensors["input_ids"], "loss_mask": batch.tensors["loss_mask"]},
        eval_set=batch.eval_set,
    )


def lease_plans(core: CoreParts) -> None:
    """A plan to every attaching producer holding a credit, while there are plans (``Leasing.lease_plan``:
    the coordinator's own replicas are served first)."""
    for peer in core.peers.live():
        if peer.role != "producer":
            continue
        while peer.credits > 0:
            plan = core.leases.lease_plan(peer.identity)
            if plan is None:
                return
            core.out.send(peer.identity, plan)
            core.peers.spend_credit(peer, plan_bytes(plan))


def send_plan(core: CoreParts, peer: Peer, plan: m.Plan) -> None:
    """A PLAN outside the producer's credits (the held-out set's)."""
    core.out.send(peer.identity, plan)
    core.peers.sent(peer, plan_bytes(plan))


def plan_bytes(plan: m.Plan) -> int:
    return sum(t.numel() * t.element_size() for t in plan.tensors.values())


def feature_bytes(batch: m.Batch) -> int:
    """Feature bytes a BATCH carries (by reference in a ring or as frames): the per-link figure the
    dashboard and ``metrics.jsonl`` show, local or remote."""
    return sum(
        t.numel() * t.element_size() for name, t in batch.tensors.items() if name.startswith("feature")
    )


LINK_KEYS = ("wire/feature_bytes_local", "wire/feature_bytes_remote")


def own_link_bytes(core: CoreParts) -> dict[str, float]:
    """Bytes this producer sent itself, by link: features to workers of its node and of other nodes, and
    the plans' tokens to attaching producers; with its produced tokens/s (what an attaching producer
    reports up, ``report_links``)."""
    totals = {key: 0.0 for key in (*LINK_KEYS, "wire/plan_bytes")}
    for peer in core.peers.values():
        if peer.role == "producer":
            totals["wire/plan_bytes"] += peer.link_bytes
        else:
            totals[f"wire/feature_bytes_{'local' if peer.same_host else 'remote'}"] += peer.link_bytes
    account = core.account
    totals["tokens_per_s/producer"] = account.target_rate.rate()
    totals["batches_via_shm"] = float(account.sent_by_ref["shm"])
    totals["batches_via_cuda_ipc"] = float(account.sent_by_ref["cuda_ipc"])
    return totals


def take_link_report(core: CoreParts, peer: Peer, msg: m.Metrics) -> bool:
    """An attaching producer's own figures (not its rank 0's training metrics): kept for ``link_bytes``
    and logged under its name. False for any other METRICS."""
    if peer.role != "producer" or not set(LINK_KEYS) <= set(msg.values) or "loss" in msg.values:
        return False
    core.peers.reported(peer, {k: float(v) for k, v in msg.values.items() if isinstance(v, (int, float))})
    core.account.log({f"producer/{peer.name}/{k}": v for k, v in peer.report.items()})
    return True


def link_bytes(core: CoreParts) -> dict[str, float]:
    """The run's bytes by link as this producer knows them: its own and the latest each attaching producer
    reported (a coordinator's totals are the whole run's), and the supply of the attached producers."""
    totals = {k: v for k, v in own_link_bytes(core).items() if k.startswith("wire/")}
    attached = [p for p in core.peers.live() if p.role == "producer"]
    for peer in core.peers.values():
        for key in LINK_KEYS:
            totals[key] += peer.report.get(key, 0.0)
    totals["tokens_per_s/attached_producers"] = sum(
        p.report.get("tokens_per_s/producer", 0.0) for p in attached
    )
    totals["producers_attached"] = float(len(attached))
    return totals
