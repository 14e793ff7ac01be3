"""ZeroMQ endpoints: a ROUTER on the producer, a DEALER on each worker. With `auth`, the only zmq importers.

- The producer binds to loopback or ipc:// without keys; any other address needs a CURVE key directory
  (`keys=DIR`, see `wire.auth`): peers whose public key is not in DIR/clients/ are refused in the
  handshake (ZAP) and logged, before any of their bytes reach the ROUTER. Workers pass the same `keys=DIR`.
  It addresses workers by their routing id. ROUTER_MANDATORY makes a message to a vanished peer an
  error (`PeerGoneError`) instead of a silent drop; a send that cannot be queued within `send_timeout_s`
  (peer not reading) raises `SendTimeoutError`, never blocks forever.
- Sends are zero-copy (`copy=False`; pyzmq still copies frames under its copy threshold). The frames keep
  the tensors alive; pass `track=True` and wait on the tracker before overwriting a reused buffer.
  Tensors over `frame_bytes` go as several frames of that size (views of the tensor, no copy); a `ring`
  passed to `ProducerEndpoint.send` sends tensors lying in its slots by reference (same-host peers only).
- Receives are zero-copy: decoded tensors view the zmq frames (a multi-frame tensor is gathered into one
  buffer from `alloc`; a ring reference views the worker's mapping of the ring). `.clone()` what you keep.
- Liveness below the protocol: ZMTP heartbeats and TCP keepalive drop dead connections, after which the
  ROUTER forgets the routing id and sends to it raise `PeerGoneError`.
- MAXMSGSIZE is set from the codec's caps, so an oversized frame disconnects the sender in libzmq before
  Python sees it. Workers never send tensors, so the producer accepts only header-sized frames
  (`INBOUND_MAX_BYTES`): a hostile peer cannot make it buffer gigabytes.
- A frame set that fails to decode is logged (rate limited) and raised as `BadMessage`; `reject()` answers
  it without ever blocking, so a flood from a peer that does not read cannot stall the producer.
- Endpoints are not thread-safe (zmq sockets are not): use each from one thread.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import TracebackType

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from dflash_pipe.wire.addresses import DEFAULT_ADDRESS, host_of, is_local_address, require_keys_for
from dflash_pipe.wire.auth import AllowList, AuthError, is_log_count, load_client_keys, load_server_keys
from dflash_pipe.wire.codec import (
    DEFAULT_MAX_TENSOR_BYTES,
    MAX_HEADER_BYTES,
    Alloc,
    SharedRing,
    decode,
    encode,
)
from dflash_pipe.wire.errors import BadMessage, PeerGoneError, ProtocolError, SendTimeoutError, TransportError
from dflash_pipe.wire.messages import Message, Reject

DEFAULT_FRAME_BYTES = 1 << 20
"""Frame size for large tensors: the fastest measured by `dflash-pipe bench transport` (docs/performance.md)."""
_HWM = 128  # messages per peer; credit-based flow keeps far fewer in flight
_HEARTBEAT_IVL_MS = 5_000
_HEARTBEAT_TIMEOUT_MS = 30_000
_KEEPALIVE = ((zmq.TCP_KEEPALIVE, 1), (zmq.TCP_KEEPALIVE_IDLE, 30), (zmq.TCP_KEEPALIVE_INTVL, 10))
INBOUND_MAX_BYTES = 4 << 20
"""Largest frame the producer accepts: workers send only headers (ACKs, metrics, tracebacks)."""
_ZAP_DOMAIN = "dflash-pipe"
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)

log = logging.getLogger("dflash_pipe.wire")


class _LogLimiter:
    """At most `burst` log lines per `window_s`, then one line saying how many were suppressed."""

    def __init__(self, burst: int = 10, window_s: float = 10.0) -> None:
        self.burst, self.window_s = burst, window_s
        self._start, self._count, self._suppressed = 0.0, 0, 0

    def warning(self, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._start > self.window_s:
            if self._suppressed:
                log.warning("... %d similar wire warnings suppressed", self._suppressed)
            self._start, self._count, self._suppressed = now, 0, 0
        self._count += 1
        if self._count <= self.burst:
            log.warning(fmt, *args)
        else:
            self._suppressed += 1


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
        self.send_timeout_s = send_timeout_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(kind)
        _configure(self._sock, max_tensor_bytes=max_tensor_bytes, hwm=hwm, send_timeout_s=send_timeout_s)
        self._closed = False
        self._monitor: zmq.Socket | None = None
        self._auth: ThreadAuthenticator | None = None
        self._limiter = _LogLimiter()

    def _watch_handshakes(self) -> None:
        """Report failed CURVE handshakes (wrong or missing keys): libzmq only tells a monitor socket."""
        self._monitor = self._sock.get_monitor_socket(_HANDSHAKE_FAILED)

    def _handshake_failures(self) -> list[dict]:
        events = []
        while self._monitor is not None and self._monitor.poll(0):
            events.append(recv_monitor_message(self._monitor))
        return events

    def _poll(self, timeout_s: float) -> list[zmq.Frame] | None:
        if self._closed:
            raise TransportError(f"{type(self).__name__} is closed")
        for event in self._handshake_failures():
            self._on_handshake_failure(event)
        if not self._sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
            return None
        return self._sock.recv_multipart(copy=False)

    def _on_handshake_failure(self, event: dict) -> None:
        """Override: what a failed handshake means on this side."""

    def close(self, linger_s: float = 1.0) -> None:
        """Close the socket, waiting up to `linger_s` for queued messages to leave. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._sock.close(linger=max(0, int(linger_s * 1000)))
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None):
        self.close()


class ProducerEndpoint(_Endpoint):
    """ROUTER socket the producer binds; workers are addressed by routing id (`peer`).

    `keys`: a key directory (`dflash-pipe keys generate DIR`); required unless `address` is loopback or
    ipc://. With it the socket is a CURVE server that admits only the public keys in DIR/clients/.
    `max_tensor_bytes` caps what a received message may declare (0: workers send no tensors).
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        keys: Path | None = None,
        max_tensor_bytes: int = 0,
        max_frame_bytes: int = INBOUND_MAX_BYTES,
        hwm: int = _HWM,
        send_timeout_s: float = 10.0,
        frame_bytes: int | None = DEFAULT_FRAME_BYTES,
    ) -> None:
        host = host_of(address)
        require_keys_for(address, keys)
        server_keys = load_server_keys(keys) if keys is not None else None
        super().__init__(
            zmq.ROUTER, max_tensor_bytes=max_tensor_bytes, hwm=hwm, send_timeout_s=send_timeout_s
        )
        self.max_frame_bytes = max_frame_bytes
        self.frame_bytes = frame_bytes
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + max_tensor_bytes)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if host is not None and ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        self.allow_list: AllowList | None = None
        if server_keys is not None:
            self.allow_list = AllowList(server_keys.allowed, server_keys.directory)
            self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger("dflash_pipe.wire.zap"))
            self._auth.start()
            self._auth.configure_curve_callback(domain=_ZAP_DOMAIN, credentials_provider=self.allow_list)
            self._sock.setsockopt_string(zmq.ZAP_DOMAIN, _ZAP_DOMAIN)
            self._sock.curve_secretkey = server_keys.secret
            self._sock.curve_publickey = server_keys.public
            self._sock.curve_server = True
            self._watch_handshakes()
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self.close(linger_s=0)
            raise TransportError(f"cannot bind {address!r}: {e}") from e
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        """The bound address with the real port (port 0 picks a free one)."""
        self.handshake_failures = 0
        """Connections refused in the CURVE handshake (missing or wrong keys)."""
        self._failures_by_kind: dict[str, int] = {}

    def _on_handshake_failure(self, event: dict) -> None:
        """Logged once per kind of failure, then at 10, 100, ... with the count (a refused worker retrying
        must not fill the log); a key the allow list refused is logged there, with the key."""
        self.handshake_failures += 1
        kind = _event_name(event)
        n = self._failures_by_kind[kind] = self._failures_by_kind.get(kind, 0) + 1
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH and self.allow_list is not None:
            return
        if is_log_count(n):
            log.warning(
                "refused a connection to %s: CURVE handshake failed (%s; %s); the peer has no keys or other keys",
                self.address,
                kind,
                "first time; later ones are counted" if n == 1 else f"{n} times so far",
            )

    def send(
        self, peer: bytes, msg: Message, *, track: bool = False, ring: SharedRing | None = None
    ) -> zmq.MessageTracker | None:
        """Send `msg` to `peer`. Raises `PeerGoneError` if the peer is unknown or disconnected,
        `SendTimeoutError` if its queue stays full for `send_timeout_s`. With `track=True`, returns a
        tracker (`.done`, `.wait(timeout)`) that tells when zmq no longer reads the tensor memory.
        `ring`: the shared ring `peer` mapped; tensors in its slots go by reference."""
        if self._closed:
            raise TransportError("ProducerEndpoint is closed")
        frames = encode(msg, frame_bytes=self.frame_bytes, ring=ring)
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

    def try_send(self, peer: bytes, msg: Message) -> bool:
        """Best-effort send that never blocks and never raises a transport error (for answers to peers
        that may not be reading); returns whether the message was queued."""
        if self._closed:
            return False
        try:
            self._sock.send_multipart([peer, *encode(msg)], copy=True, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def reject(self, peer: bytes, reason: str) -> bool:
        """Answer `peer` with REJECT(reason) and log it (rate limited); never blocks or raises."""
        self._limiter.warning("REJECT to peer %s: %.300s", peer.hex(), reason)
        return self.try_send(peer, Reject(reason=reason[:2000]))

    def recv(self, timeout_s: float) -> tuple[bytes, Message] | None:
        """Next `(peer, message)`, or None after `timeout_s`. A frame set that fails to decode is logged
        (rate limited) and raises `BadMessage` carrying the peer id; the endpoint stays usable."""
        parts = self._poll(timeout_s)
        if parts is None:
            return None
        peer = parts[0].bytes
        try:
            return peer, decode(
                parts[1:], max_tensor_bytes=self.max_tensor_bytes, max_header_bytes=self.max_frame_bytes
            )
        except ProtocolError as e:
            self._limiter.warning("bad message from peer %s: %.300s", peer.hex(), e)
            raise BadMessage(peer, e) from e


class WorkerEndpoint(_Endpoint):
    """DEALER socket a worker connects to the producer with.

    `keys`: the run's key directory (the producer of a non-loopback address requires one). A producer that
    refuses this worker's key makes `recv` raise `AuthError` naming the fix, instead of a silent wait.
    """

    def __init__(
        self,
        address: str,
        *,
        keys: Path | None = None,
        max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
        hwm: int = _HWM,
        send_timeout_s: float = 10.0,
        alloc: Alloc | None = None,
    ) -> None:
        if keys is None and not is_local_address(address):
            raise ValueError(
                f"connecting to {address!r} needs CURVE keys: a producer on a non-loopback address accepts "
                "only workers with its keys. Pass `--keys DIR` with the producer's key directory (at least "
                "client.key_secret and server.key)."
            )
        client_keys = load_client_keys(keys) if keys is not None else None
        super().__init__(
            zmq.DEALER, max_tensor_bytes=max_tensor_bytes, hwm=hwm, send_timeout_s=send_timeout_s
        )
        self.address = address
        self.ring: SharedRing | None = None
        """The producer's ring once mapped (set after WELCOME): BATCH headers may then name its slots."""
        self.alloc = alloc
        """Where multi-frame tensors are reassembled (None: plain host memory)."""
        if client_keys is not None:
            self._sock.curve_secretkey = client_keys.secret
            self._sock.curve_publickey = client_keys.public
            self._sock.curve_serverkey = client_keys.server_public
        self._watch_handshakes()  # also tells a keyless worker that the producer wants keys
        self.keys = keys
        try:
            self._sock.connect(address)
        except zmq.ZMQError as e:
            self.close(linger_s=0)
            raise TransportError(f"cannot connect to {address!r}: {e}") from e

    def _on_handshake_failure(self, event: dict) -> None:
        if self.keys is None:
            why = "it requires CURVE keys and this worker has none"
        elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = f"it does not list this worker's public key (from {self.keys}) in its clients/ directory"
        else:
            why = f"it holds other keys than {self.keys}/server.key, or runs without keys"
        raise AuthError(
            f"the producer at {self.address} refused the CURVE handshake ({_event_name(event)}): {why}. "
            "Pass `--keys DIR` with the same key directory to `dflash-pipe launch` and `dflash-pipe worker`."
        )

    def send(self, msg: Message, *, track: bool = False) -> zmq.MessageTracker | None:
        """Send `msg` to the producer; raises `SendTimeoutError` if it cannot be queued in time."""
        if self._closed:
            raise TransportError("WorkerEndpoint is closed")
        frames = encode(msg)
        try:
            tracker = self._sock.send_multipart(frames, copy=False, track=track)
        except zmq.Again:
            for event in self._handshake_failures():  # not slow: refused (raises AuthError)
                self._on_handshake_failure(event)
            raise SendTimeoutError(None, f"producer at {self.address} is not reading") from None
        except zmq.ZMQError as e:
            raise TransportError(f"send to {self.address} failed: {e}") from e
        return tracker if track else None

    def recv(self, timeout_s: float) -> Message | None:
        """Next message from the producer, or None after `timeout_s`; raises `ProtocolError` if malformed."""
        parts = self._poll(timeout_s)
        if parts is None:
            return None
        extra = {} if self.alloc is None else {"alloc": self.alloc}
        return decode(parts, max_tensor_bytes=self.max_tensor_bytes, ring=self.ring, **extra)

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


_PROTOCOL_ERRORS = {
    getattr(zmq, n): n.removeprefix("PROTOCOL_ERROR_") for n in dir(zmq) if n.startswith("PROTOCOL_ERROR_")
}


def _event_name(event: dict) -> str:
    """E.g. "HANDSHAKE_FAILED_PROTOCOL: ZMTP_MECHANISM_MISMATCH" or "HANDSHAKE_FAILED_AUTH: status 400"."""
    kind, value = event.get("event"), event.get("value")
    name = zmq.Event(kind).name if kind in zmq.Event._value2member_map_ else f"event {kind}"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"{name}: ZAP status {value}"
    return f"{name}: {_PROTOCOL_ERRORS.get(value, value)}"
