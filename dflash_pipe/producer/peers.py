"""Who is in the run: the workers and attached producers the core heard a HELLO from, and what it knows of each.

``Peers`` owns the table and every ``Peer`` record in it: admission adds one (``producer.handshake``
decides whether and how), the handlers mark what each message says (READY's credits and ring, an ACK's
step, BYE, SERVING), and the watch drops the silent. It also keeps the lines of the lost and the
drafters' wait for ``train.min_workers``. Nothing outside this class writes these fields (a test reads
the code to keep it so); the core reads them and calls the methods.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from dflash_pipe.wire import messages as m


@dataclass(slots=True)
class GroupWait:
    """The drafters' group is below ``train.min_workers`` and has taken no step in this launch
    (``producer.min_workers``)."""

    since: float
    """When the producer first heard of it (monotonic)."""
    needed: int
    present: int


@dataclass(slots=True)
class Peer:
    """A worker (or an attaching producer) in the run, as the core tracks it from its HELLO on."""

    identity: bytes
    name: str
    device: str
    host: str
    pid: int
    rank: int = -1
    credits: int = 0
    last_heard: float = field(default_factory=time.monotonic)
    state: str = "joining"
    steps: int = 0
    first_step_s: float | None = None
    left: bool = False
    ring_offered: bool = False
    cuda_offered: bool = False
    shm: bool = False
    """The worker mapped the shared-memory ring: its BATCH headers name slots instead of carrying frames."""
    cuda_ipc: bool = False
    """The worker opened the CUDA IPC ring: its BATCH headers name slots in the target GPU's memory."""
    role: str = "worker"
    """"producer": target replicas attached from another node, leasing PLANs (``producer.coordinator``)."""
    host_id: str = ""
    """Its ``wire.shm.host_identity()``: which node it runs on."""
    same_host: bool = False
    """Same host identity as this producer: what it is sent stays on the node."""
    serves: str = ""
    """An attaching producer's address for the workers of its node (its SERVING), "" until it says: the
    coordinator redirects a worker of that node there (``handshake.redirect_for``)."""
    link_bytes: int = 0
    """Bytes of features sent to this worker, or of plans' tokens to this producer."""
    report: dict[str, float] = field(default_factory=dict)
    """An attaching producer's latest own figures (its links' bytes, its tokens/s)."""

    @classmethod
    def from_hello(cls, identity: bytes, msg: m.Hello, *, here: str, **offers: bool) -> Peer:
        """The record of a peer admitted on its HELLO; ``here``: this producer's host identity (same node or
        not). ``offers``: the rings offered to a worker (``cuda_offered``, ``ring_offered``)."""
        return cls(
            identity=identity,
            name=msg.worker_name,
            device=msg.device,
            host=msg.host,
            pid=msg.pid,
            role=msg.role,
            host_id=msg.host_id,
            same_host=bool(here) and msg.host_id == here,
            **offers,
        )


class Peers:
    """The run's peers by ZeroMQ identity, the lost, the redirected and the group's wait."""

    def __init__(self) -> None:
        self._by_id: dict[bytes, Peer] = {}
        self.lost: list[str] = []
        """One line per worker that died or vanished (the run went on without it)."""
        self.redirected = 0
        """Workers sent to the producer of their own node instead of being welcomed here."""
        self.group_wait: GroupWait | None = None
        """The drafters wait for ``train.min_workers`` before this launch's first step (``min_workers``)."""
        self.last_beat = 0.0
        """When the latest round of HEARTBEATs went out (monotonic)."""

    # --- reading -----------------------------------------------------------------------------------------

    def get(self, identity: bytes) -> Peer | None:
        return self._by_id.get(identity)

    def __getitem__(self, identity: bytes) -> Peer:
        return self._by_id[identity]

    def values(self) -> Iterator[Peer]:
        """Every peer ever admitted, in arrival order (the left and lost too)."""
        return iter(list(self._by_id.values()))

    def __contains__(self, identity: object) -> bool:
        """Whether a peer of this ZeroMQ identity was ever admitted (as ``in`` on the dict it replaced)."""
        return identity in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def live(self) -> list[Peer]:
        return [p for p in self._by_id.values() if not p.left]

    def all_left(self) -> bool:
        return all(p.left for p in self._by_id.values())

    def named(self, name: str) -> Peer | None:
        """The live peer called ``name``, if any."""
        return next((p for p in self._by_id.values() if p.name == name and not p.left), None)

    def node_producer(self, host_id: str) -> Peer | None:
        """An attaching producer on the node ``host_id`` names, if one is in the run."""
        if not host_id:
            return None
        return next((p for p in self.live() if p.role == "producer" and p.host_id == host_id), None)

    # --- admission and leaving ---------------------------------------------------------------------------

    def add(self, peer: Peer) -> Peer:
        """An admitted peer; a worker's rank is its arrival order among the live workers (for the dashboard:
        the drafters' rendezvous gives the real ranks)."""
        if peer.role == "worker":
            peer.rank = sum(1 for p in self.live() if p.role == "worker")
        peer.state = "starting"
        self._by_id[peer.identity] = peer
        return peer

    def count_redirect(self) -> int:
        self.redirected += 1
        return self.redirected

    def mark_lost(self, peer: Peer, why: str) -> str:
        """``peer`` died or vanished: the line the summary, the log and the dashboard show."""
        peer.left, peer.state = True, "lost"
        line = f"{peer.role} {peer.name} ({peer.device}, pid {peer.pid}) {why}"
        self.lost.append(line)
        return line

    def lost_before_hello(self, name: str, why: str) -> None:
        """A launched worker died before it said HELLO: no record, only its line."""
        self.lost.append(f"{name} {why}")

    def said_bye(self, peer: Peer) -> None:
        peer.left, peer.state = True, "left"

    # --- what each message says --------------------------------------------------------------------------

    def heard(self, peer: Peer) -> None:
        peer.last_heard = time.monotonic()

    def ready(self, peer: Peer, msg: m.Ready) -> str | None:
        """READY's credits; the first READY also says which ring the worker could open. Returns a warning
        when it could not open the CUDA IPC ring it was offered."""
        note = None
        if peer.state == "starting":
            peer.cuda_ipc = msg.cuda_ipc and peer.cuda_offered
            peer.shm = msg.shm and peer.ring_offered and not peer.cuda_ipc
            if peer.cuda_offered and not peer.cuda_ipc:
                fallback = "shared memory" if peer.shm else "frames"
                note = (
                    f"warning: {peer.name} could not open the CUDA IPC ring (see its log); its payloads go "
                    f"through {fallback}"
                )
        peer.credits += msg.credits
        peer.state = "training"
        return note

    def spend_credit(self, peer: Peer, sent_bytes: int) -> None:
        """A BATCH (or PLAN) went to ``peer``: one credit used, ``sent_bytes`` on its link."""
        peer.credits -= 1
        peer.link_bytes += sent_bytes

    def sent(self, peer: Peer, sent_bytes: int) -> None:
        """Bytes sent to ``peer`` outside its credits (the held-out set's BATCHes or PLANs)."""
        peer.link_bytes += sent_bytes

    def stepped(self, peer: Peer, step: int) -> None:
        peer.steps = step

    def first_step(self, peer: Peer, seconds: float) -> None:
        peer.first_step_s = seconds

    def serving(self, peer: Peer, address: str) -> bool:
        """An attached producer's SERVING; True when the address is new."""
        if peer.serves == address:
            return False
        peer.serves = address
        return True

    def reported(self, peer: Peer, values: dict[str, float]) -> None:
        """An attaching producer's own figures (its links' bytes, its tokens/s)."""
        peer.report = values

    # --- the drafters' wait for min_workers ----------------------------------------------------------------

    def heard_waiting(self, needed: int, present: int) -> None:
        if self.group_wait is None:
            self.group_wait = GroupWait(since=time.monotonic(), needed=needed, present=present)
        self.group_wait.needed, self.group_wait.present = needed, present

    def wait_ended(self) -> None:
        self.group_wait = None

    def beat_due(self, now: float, every_s: float) -> bool:
        """True (and the round counted as sent) when HEARTBEATs are due."""
        if now - self.last_beat < every_s:
            return False
        self.last_beat = now
        return True
