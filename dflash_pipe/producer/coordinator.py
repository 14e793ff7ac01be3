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

import time
from typing import TYPE_CHECKING

import msgspec
import torch

from dflash_pipe.producer.handshake import refusal, welcome
from dflash_pipe.producer.state import Peer
from dflash_pipe.producer.target_threads import pack
from dflash_pipe.wire import messages as m

if TYPE_CHECKING:
    from dflash_pipe.producer.state import CoreState


def admit_producer(core: CoreState, peer_id: bytes, msg: m.Hello) -> Peer | None:
    """WELCOME with the run's config and the held-out set's PLANs, or REJECT naming why."""
    if (why := refusal(core, msg)) is not None:
        core.out.reject(peer_id, why)
        return None
    peer = Peer(
        identity=peer_id, name=msg.worker_name, device=msg.device, host=msg.host, pid=msg.pid, role="producer"
    )
    peer.host_id = msg.host_id
    peer.same_host = bool(core.host_id) and msg.host_id == core.host_id
    peer.state = "starting"
    core.peers[peer_id] = peer
    hello = msgspec.structs.replace(welcome(core, peer, len(core.eval_batches)), config=core.cfg.to_dict())
    core.out.send(peer_id, hello)
    for batch in core.eval_batches:
        if peer.left:
            break
        send_plan(core, peer, eval_plan(batch))
    core.note(f"producer {peer.name} ({peer.device} on {peer.host}) attached at step {core.step}")
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


def lease_plans(core: CoreState) -> None:
    """A plan to every attaching producer holding a credit, while there are plans. The coordinator's own
    replicas are served first (``ProducerCore.refill`` runs before this), so a producer that attaches takes
    only what would otherwise wait."""
    for peer in core.peers.values():
        if peer.role != "producer" or peer.left:
            continue
        while peer.credits > 0:
            plan = core.scheduler.next_plan()
            if plan is None:
                return
            ids, mask, lengths = pack([core.ctx.train_samples[i] for i in plan.sample_ids])
            core.scheduler.lease_plan(peer.identity, plan, tokens=int(ids.numel()), now=time.monotonic())
            send_plan(
                core,
                peer,
                m.Plan(
                    batch_id=plan.batch_id,
                    epoch=plan.epoch,
                    sample_ids=plan.sample_ids,
                    lengths=lengths,
                    tensors={"input_ids": ids, "loss_mask": mask.to(torch.uint8)},
                ),
            )
            peer.credits -= 1


def send_plan(core: CoreState, peer: Peer, plan: m.Plan) -> None:
    core.out.send(peer.identity, plan)
    peer.link_bytes += sum(t.numel() * t.element_size() for t in plan.tensors.values())


def count_features(peer: Peer, batch: m.Batch) -> None:
    """Feature bytes a BATCH carries to ``peer`` (by reference in a ring or as frames): the per-link figure
    the dashboard and ``metrics.jsonl`` show, local or remote."""
    peer.link_bytes += sum(
        t.numel() * t.element_size() for name, t in batch.tensors.items() if name.startswith("feature")
    )


LINK_KEYS = ("wire/feature_bytes_local", "wire/feature_bytes_remote")


def own_link_bytes(core: CoreState) -> dict[str, float]:
    """Bytes this producer sent itself, by link: features to workers of its node and of other nodes, and
    the plans' tokens to attaching producers; with its produced tokens/s (what an attaching producer
    reports up, ``report_links``)."""
    totals = {key: 0.0 for key in (*LINK_KEYS, "wire/plan_bytes")}
    for peer in core.peers.values():
        if peer.role == "producer":
            totals["wire/plan_bytes"] += peer.link_bytes
        else:
            totals[f"wire/feature_bytes_{'local' if peer.same_host else 'remote'}"] += peer.link_bytes
    totals["tokens_per_s/producer"] = core.target_rate.rate()
    totals["batches_via_shm"] = float(core.sent_by_ref["shm"])
    totals["batches_via_cuda_ipc"] = float(core.sent_by_ref["cuda_ipc"])
    return totals


def take_link_report(core: CoreState, peer: Peer, msg: m.Metrics) -> bool:
    """An attaching producer's own figures (not its rank 0's training metrics): kept for ``link_bytes``
    and logged under its name. False for any other METRICS."""
    if peer.role != "producer" or not set(LINK_KEYS) <= set(msg.values) or "loss" in msg.values:
        return False
    peer.report = {k: float(v) for k, v in msg.values.items() if isinstance(v, (int, float))}
    core.metrics.log({f"producer/{peer.name}/{k}": v for k, v in peer.report.items()}, core.step)
    return True


def link_bytes(core: CoreState) -> dict[str, float]:
    """The run's bytes by link as this producer knows them: its own and the latest each attaching producer
    reported (a coordinator's totals are the whole run's), and the supply of the attached producers."""
    totals = {k: v for k, v in own_link_bytes(core).items() if k.startswith("wire/")}
    attached = [p for p in core.peers.values() if p.role == "producer" and not p.left]
    for peer in core.peers.values():
        for key in LINK_KEYS:
            totals[key] += peer.report.get(key, 0.0)
    totals["tokens_per_s/attached_producers"] = sum(
        p.report.get("tokens_per_s/producer", 0.0) for p in attached
    )
    totals["producers_attached"] = float(len(attached))
    return totals
