"""What the core's handlers in their own modules (``handshake``, ``coordinator``, ``display``,
``min_workers``) see of it: its three components, its settings and its outbox, typed as a Protocol so
those modules do not import the core that imports them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from dflash_pipe.producer.accounting import Accounting
    from dflash_pipe.producer.leasing import Leasing
    from dflash_pipe.producer.peers import Peer, Peers
    from dflash_pipe.producer.rings import Rings
    from dflash_pipe.producer.setup import RunContext
    from dflash_pipe.run.config import RunConfig
    from dflash_pipe.wire import messages as m


class Outbox(Protocol):
    """How the core talks to workers (the process shell's socket; a list in a test)."""

    def send(self, peer_id: bytes, msg: Any, *, ring: Any = None) -> None:
        """Send ``msg``; a peer that is gone is dropped (``ProducerCore.drop``), never raised."""
        ...

    def reject(self, peer_id: bytes, reason: str) -> None:
        """Answer REJECT without ever blocking (the peer may not be reading)."""
        ...

    def redirect(self, peer_id: bytes, msg: m.Redirect) -> None:
        """Answer REDIRECT without ever blocking: like REJECT, the last word to a peer that never joins."""
        ...


class CoreParts(Protocol):
    """A ``ProducerCore`` as its handlers use it: they read the components and call their methods."""

    ctx: RunContext
    cfg: RunConfig
    out: Outbox
    rings: Rings
    host_id: str
    rendezvous: str
    peers: Peers
    leases: Leasing
    account: Accounting

    def note(self, text: str) -> None: ...

    def drop(self, peer: Peer, why: str) -> None: ...
