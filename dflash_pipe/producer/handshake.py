"""The handshake: a worker's HELLO answered with WELCOME (and the eval batches, or word that they come
later: the held-out set is still being regenerated), REJECT naming why, or REDIRECT to the producer of
the worker's own node.

A worker is admitted when it speaks this protocol version, supports frames, the run is not finishing and
``wire.payload_path`` can serve it; ``choose_offers`` says which same-host ring it is offered. The run's
coordinator first sends a worker from a node where an attached producer serves (``redirect_for``) to that
producer, so its features stay on its node: only gradients and control messages cross nodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dflash_pipe.producer.peers import Peer
from dflash_pipe.wire import messages as m

if TYPE_CHECKING:
    from dflash_pipe.producer.parts import CoreParts

REQUIRED_CAPABILITIES = ("frames",)
"""What a worker must support: payloads as raw tensor frames on the socket."""


def refusal(core: CoreParts, msg: m.Hello) -> str | None:
    """Why a HELLO (a worker's or an attaching producer's) is refused, or None: another protocol, missing
    capabilities, a finishing run, or a name already in the run."""
    if msg.protocol_version != m.PROTOCOL_VERSION:
        return f"protocol {msg.protocol_version} != producer's {m.PROTOCOL_VERSION}"
    missing = sorted(set(REQUIRED_CAPABILITIES) - set(msg.capabilities))
    if missing:
        return f"{msg.role} lacks capabilities {missing}; upgrade dflash-pipe there"
    if core.leases.done_sent:
        return "this run is finishing; attach to the next one"
    taken = core.peers.named(msg.worker_name)
    if taken is not None and (taken.host, taken.pid) == (msg.host, msg.pid):  # the same process, reconnecting
        core.drop(taken, "reconnected (a new connection from the same process)")
        taken = None
    if taken is not None:  # names key the dashboard, the logs and the launcher's adoption of its workers
        core.note(f"refused a second {msg.role} named {msg.worker_name!r} ({msg.host}, pid {msg.pid})")
        return (
            f"a {taken.role} named {msg.worker_name!r} is already in this run ({taken.device} on {taken.host}, "
            f"pid {taken.pid}); start this one with another --name"
        )
    return None


def admit(core: CoreParts, peer_id: bytes, msg: m.Hello) -> Peer | None:
    """Admits a worker: WELCOME and the eval batches, or REJECT naming why."""
    if (why := refusal(core, msg)) is not None:
        core.out.reject(peer_id, why)
        return None
    if (redirect := redirect_for(core, msg)) is not None:
        core.out.redirect(peer_id, redirect)
        core.account.log({"workers_redirected": float(core.peers.count_redirect())})
        core.note(
            f"{msg.worker_name} ({msg.device} on {msg.host}) sent to producer {redirect.producer} at "
            f"{redirect.address}: it runs on that worker's node, so its features stay there"
        )
        return None
    same_host = bool(core.host_id) and msg.host_id == core.host_id
    try:
        cuda_offered, ring_offered = choose_offers(
            core.cfg.wire.payload_path,
            msg.capabilities,
            same_host=same_host,
            cuda_ring=core.rings.cuda is not None,
            shm_ring=core.rings.shm is not None,
        )
    except ValueError as exc:
        core.out.reject(peer_id, str(exc))
        return None
    # Ranks come from the drafters' rendezvous, not from here: ``Peers.add`` numbers workers in arrival
    # order, for the dashboard. Every worker gets the eval set, since any of them may become rank 0.
    peer = core.peers.add(
        Peer.from_hello(peer_id, msg, here=core.host_id, cuda_offered=cuda_offered, ring_offered=ring_offered)
    )
    if not same_host and (local := core.peers.node_producer(msg.host_id)) is not None:
        core.note(network_warning(peer, local, redirects=m.REDIRECT_CAPABILITY in msg.capabilities))
    eval_batches = core.leases.eval_batches
    # Through the outbox: a peer that hangs up right after its HELLO is dropped, never fatal.
    core.out.send(peer.identity, welcome(core, peer, len(eval_batches)))
    for batch in eval_batches:
        if peer.left:
            break
        core.out.send(peer.identity, batch)
    if core.account.step > 0:
        core.note(f"{peer.name} ({peer.device}) joins the run at step {core.account.step}")
    return peer


def redirect_for(core: CoreParts, msg: m.Hello) -> m.Redirect | None:
    """REDIRECT for a worker whose node has an attached producer serving it, or None (welcome it here).

    Only the coordinator redirects: an attached producer serves its own node, so a redirect never bounces.
    Only a worker that follows redirects (``wire.messages.REDIRECT_CAPABILITY``), never one on this
    producer's own node, and only to a producer that is live and said where it serves (SERVING, sent once
    its loop answers HELLOs: a worker sent there is answered at once). If it dies before the worker's HELLO, the worker
    comes back after ``timeout_s`` (the run's peer timeout, by which the producer is dropped here too)
    without the capability and is welcomed here."""
    if core.ctx.attached or m.REDIRECT_CAPABILITY not in msg.capabilities:
        return None
    if core.host_id and msg.host_id == core.host_id:
        return None
    local = core.peers.node_producer(msg.host_id)
    if local is None or not local.serves:
        return None
    return m.Redirect(producer=local.name, address=local.serves, timeout_s=core.cfg.wire.peer_timeout_s)


def network_warning(peer: Peer, local: Peer, *, redirects: bool) -> str:
    """Why a worker welcomed here is fed over the network although producer ``local`` runs on its node,
    and what keeps its features there."""
    if redirects:  # it would have followed: that producer did not say where it serves yet
        why = "which did not serve yet (its target was loading); restart the worker to be sent there"
    else:
        why = (
            "but this worker did not follow a redirect (`worker --no-redirect`, or that producer did not "
            "answer it); restart it without --no-redirect, or connect it to that producer's address"
        )
    return (
        f"warning: {peer.name} gets its features over the network, but producer {local.name} runs on its "
        f"node, {why}"
    )


def welcome(core: CoreParts, peer: Peer, eval_batches: int) -> m.Welcome:
    wire, rings = core.cfg.wire, core.rings
    return m.Welcome(
        run_id=core.ctx.run_id,
        rendezvous=core.rendezvous,
        run_dir=str(core.cfg.run_dir.resolve()),
        target_path=str(Path(core.ctx.target_path).resolve()),
        drafter=core.ctx.drafter.to_dict(),
        train=core.cfg.train.to_dict(),
        resume_from=core.account.last_checkpoint
        or (str(core.ctx.resume_from) if core.ctx.resume_from else None),
        heartbeat_s=wire.heartbeat_s,
        peer_timeout_s=wire.peer_timeout_s,
        num_samples=len(core.ctx.train_samples),
        credits=wire.worker_credits,
        eval_batches=eval_batches,
        eval_pending=core.leases.eval_pending,
        ring=rings.shm.offer().to_dict() if peer.ring_offered and rings.shm is not None else {},
        cuda_ring=rings.cuda.offer().to_dict() if peer.cuda_offered and rings.cuda is not None else {},
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
