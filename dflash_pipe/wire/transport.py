"""ZeroMQ endpoints: a ROUTER on the producer, a DEALER on each worker. The only module that imports zmq.

- The producer binds (loopback unless `allow_public=True`: the wire has no authentication yet, CURVE comes
  later) and addresses workers by their routing id. ROUTER_MANDATORY makes a message to a vanished peer an
  error (`PeerGoneError`) instead of a silent drop; a send that cannot be queued within `send_timeout_s`
  (peer not reading) raises `SendTimeoutError`, never blocks forever.
- Sends are zero-copy (`copy=False`; pyzmq still copies frames under its copy threshold). The frames keep
  the tensors alive; pass `track=True` and wait on the tracker before overwriting a reused buffer.
- Receives are zero-copy: decoded tensors view the zmq frames. `.clone()` what you keep.
- Liveness below the protocol: ZMTP heartbeats and TCP keepalive drop dead connections, after which the
  ROUTER forgets the routing id and sends to it raise `PeerGoneError`.
- MAXMSGSIZE is set from the codec's tensor cap, so an oversized frame disconnects the sender in libzmq
  before Python sees it.
- Endpoints are not thread-safe (zmq sockets are not): use each from one thread.
"""

from __future__ import annotations

import ipaddress
from types import TracebackType

import zmq

from dflash_pipe.wire.codec import DEFAULT_MAX_TENSOR_BYTES, MAX_HEADER_BYTES, decode, encode
from dflash_pipe.wire.errors import BadMessage, PeerGoneError, ProtocolError, SendTimeoutError, TransportError
from dflash_pipe.wire.messages import Message

DEFAULT_ADDRESS = "tcp://127.0.0.1:0"
_HWM = 128  # messages per peer; credit-based flow keeps far fewer in flight
_HEARTBEAT_IVL_MS = 5_000
_HEARTBEAT_TIMEOUT_MS = 30_000
_KEEPALIVE = ((zmq.TCP_KEEPALIVE, 1), (zmq.TCP_KEEPALIVE_IDLE, 30), (zmq.TCP_KEEPALIVE_INTVL, 10))


def _host_of(address: str) -> str | None:
    """The host part of a tcp:// address, or None for ipc://, inproc:// (local by construction)."""
    transport, sep, rest = address.partition("://")
    if not sep:
        raise ValueError(f"address {address!r} has no transport; use 'tcp://127.0.0.1:0' or 'ipc:///path'")
    if transport in ("ipc", "inproc"):
        return None
    if transport != "tcp":
        raise ValueError(f"address {address!r}: transport {transport!r} not supported; use tcp:// or ipc://")
    host, colon, port = rest.rpartition(":")
    if not colon or not host or not port:
        raise ValueError(f"address {address!r} needs a host and a port, e.g. 'tcp://127.0.0.1:0'")
    return host.strip("[]")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", "0.0.0.0", interface names, host names


def _configure(sock: zmq.Socket, *, max_tensor_bytes: int, hwm: int, send_timeout_s: float) -> None:
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.SNDTIMEO, max(0, int(send_timeout_s * 1000)))
    sock.setsockopt(zmq.MAXMSGSIZE, max_tensor_bytes + MAX_HEADER_BYTES)  # per frame in libzmq
    sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
    for opt, value in _KEEPALIVE:
        sock.setsockopt(opt, value)


class _Endpoint:
    """Shared socket lifecycle: own context, idempotent close with linger, context-manager use."""

    def __init__(self, kind: int, *, max_tensor_bytes: int, hwm: int, send_timeout_s: float) -> None:
        if max_tensor_bytes < 0:
            raise ValueError(f"max_tensor_bytes={max_tensor_bytes} must be >= 0")
        if hwm < 1:
            raise ValueError(f"hwm={hwm} must be >= 1 (messages queued per peer)")
        if send_timeout_s < 0:
            raise ValueError(f"send_timeout_s={send_timeout_s} must be >= 0")
        self.max_tensor_bytes = max_tensor_bytes
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(kind)
        _configure(self._sock, max_tensor_bytes=max_tensor_bytes, hwm=hwm, send_timeout_s=send_timeout_s)
        self._closed = False

    def _poll(self, timeout_s: float) -> list[zmq.Frame] | None:
        if self._closed:
            raise TransportError(f"{type(self).__name__} is closed")
        if not self._sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
            return None
        return self._sock.recv_multipart(copy=False)

    def close(self, linger_s: float = 1.0) -> None:
        """Close the socket, waiting up to `linger_s` for queued messages to leave. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._sock.close(linger=max(0, int(linger_s * 1000)))
        self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None):
        self.close()


class ProducerEndpoint(_Endpoint):
    """ROUTER socket the producer binds; workers are addressed by routing id (`peer`)."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        allow_public: bool = False,
        max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
        hwm: int = _HWM,
        send_timeout_s: float = 10.0,
    ) -> None:
        host = _host_of(address)
        if host is not None and not allow_public and not _is_loopback(host):
            raise ValueError(
                f"refusing to bind {address!r}: not a loopback address, and the wire is not authenticated "
                "(anyone who can connect could feed or read the run). Bind 127.0.0.1 or ipc://, or pass "
                "allow_public=True on a trusted network."
            )
        super().__init__(
            zmq.ROUTER, max_tensor_bytes=max_tensor_bytes, hwm=hwm, send_timeout_s=send_timeout_s
        )
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if host is not None and ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self.close(linger_s=0)
            raise TransportError(f"cannot bind {address!r}: {e}") from e
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        """The bound address with the real port (port 0 picks a free one)."""

    def send(self, peer: bytes, msg: Message, *, track: bool = False) -> zmq.MessageTracker | None:
        """Send `msg` to `peer`. Raises `PeerGoneError` if the peer is unknown or disconnected,
        `SendTimeoutError` if its queue stays full for `send_timeout_s`. With `track=True`, returns a
        tracker (`.done`, `.wait(timeout)`) that tells when zmq no longer reads the tensor memory."""
        if self._closed:
            raise TransportError("ProducerEndpoint is closed")
        frames = encode(msg)
        try:
            # ROUTER checks routability and the HWM on the routing-id frame, so no partial message is queued.
            tracker = self._sock.send_multipart([peer, *frames], copy=False, track=track)
        except zmq.Again:
            raise SendTimeoutError(peer, "its queue stayed full (it is not reading); give up on it") from None
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise PeerGoneError(peer, "no connection with this routing id (disconnected?)") from None
            raise TransportError(f"send to peer {peer.hex()} failed: {e}") from e
        return tracker if track else None

    def recv(self, timeout_s: float) -> tuple[bytes, Message] | None:
        """Next `(peer, message)`, or None after `timeout_s`. A frame set that fails to decode raises
        `BadMessage` carrying the peer id; the endpoint stays usable."""
        parts = self._poll(timeout_s)
        if parts is None:
            return None
        peer = parts[0].bytes
        try:
            return peer, decode(parts[1:], max_tensor_bytes=self.max_tensor_bytes)
        except ProtocolError as e:
            raise BadMessage(peer, e) from e


class WorkerEndpoint(_Endpoint):
    """DEALER socket a worker connects to the producer with."""

    def __init__(
        self,
        address: str,
        *,
        max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
        hwm: int = _HWM,
        send_timeout_s: float = 10.0,
    ) -> None:
        _host_of(address)  # clear error for a malformed address
        super().__init__(
            zmq.DEALER, max_tensor_bytes=max_tensor_bytes, hwm=hwm, send_timeout_s=send_timeout_s
        )
        self.address = address
        try:
            self._sock.connect(address)
        except zmq.ZMQError as e:
            self.close(linger_s=0)
            raise TransportError(f"cannot connect to {address!r}: {e}") from e

    def send(self, msg: Message, *, track: bool = False) -> zmq.MessageTracker | None:
        """Send `msg` to the producer; raises `SendTimeoutError` if it cannot be queued in time."""
        if self._closed:
            raise TransportError("WorkerEndpoint is closed")
        frames = encode(msg)
        try:
            tracker = self._sock.send_multipart(frames, copy=False, track=track)
        except zmq.Again:
            raise SendTimeoutError(None, f"producer at {self.address} is not reading") from None
        except zmq.ZMQError as e:
            raise TransportError(f"send to {self.address} failed: {e}") from e
        return tracker if track else None

    def recv(self, timeout_s: float) -> Message | None:
        """Next message from the producer, or None after `timeout_s`; raises `ProtocolError` if malformed."""
        parts = self._poll(timeout_s)
        if parts is None:
            return None
        return decode(parts, max_tensor_bytes=self.max_tensor_bytes)

    def send_final(self, msg: Message, *, linger_s: float = 2.0) -> bool:
        """Last words of a dying process (usually ERROR): queue `msg`, then close, waiting up to `linger_s`
        for it to leave. Never raises a transport error over the original failure; returns whether the
        message was queued."""
        if self._closed:
            return False
        try:
            frames = encode(msg)
            self._sock.send_multipart(frames, copy=True, flags=zmq.NOBLOCK)
            queued = True
        except (zmq.ZMQError, ProtocolError):
            queued = False
        self.close(linger_s=linger_s)
        return queued
