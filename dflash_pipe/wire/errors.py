"""Typed errors of the wire: malformed input is a `ProtocolError`, a peer that is gone is a `PeerGoneError`.

`ProtocolError` subclasses `ValueError` so message construction (which validates its fields) reads like any
other bad-argument error; the transport errors subclass `ConnectionError`.
"""

from __future__ import annotations


class ProtocolError(ValueError):
    """A message or frame set is malformed: bad header, unknown kind, wrong field, bad tensor table."""


class ProtocolVersionError(ProtocolError):
    """The peer speaks another wire protocol version; both sides must run the same dflash-pipe release."""

    def __init__(self, *, theirs: object, ours: int) -> None:
        self.theirs = theirs
        self.ours = ours
        super().__init__(
            f"wire protocol version mismatch: peer sent v{theirs!r}, this side speaks v{ours}. "
            "Run the same dflash-pipe version on the producer and every worker."
        )


class BadMessage(ProtocolError):
    """A frame set from `peer` failed to decode; `error` says why. The producer can answer REJECT/ERROR
    to that peer and carry on serving the others."""

    def __init__(self, peer: bytes, error: ProtocolError) -> None:
        self.peer = peer
        self.error = error
        super().__init__(f"bad message from peer {peer.hex()}: {error}")


class TransportError(ConnectionError):
    """A socket-level failure of the wire (not a malformed message)."""


class PeerGoneError(TransportError):
    """The peer cannot be reached: it disconnected, never connected, or its routing id is unknown."""

    def __init__(self, peer: bytes | None, detail: str) -> None:
        self.peer = peer
        who = f"peer {peer.hex()}" if peer is not None else "peer"
        super().__init__(f"{who} is gone: {detail}")


class SendTimeoutError(PeerGoneError):
    """The peer is connected but has not drained its queue within the send timeout (stuck or dead host)."""
