"""Wire: the producer <-> worker protocol (ROUTER/DEALER, msgpack header + raw tensor frames).

``messages`` holds the message types and the protocol version, ``codec`` turns them into frames and back,
``transport`` owns the sockets and ``auth`` the CURVE key files (the only two modules that import zmq),
``addresses`` says which addresses need keys, ``slots``, ``ring``, ``shm`` and ``cuda_ipc`` hold the memory
payloads live in, ``fp8`` the feature encoding. It imports nothing else of the package: it is the bottom
layer. Non-loopback addresses need keys (``dflash-pipe keys generate DIR``); see docs/security.md.

Names load on first use (PEP 562): the run config reads ``addresses`` without loading torch (the codec)
or pyzmq (the endpoints); ``from dflash_pipe.wire import Batch, decode`` works as before.
"""

from __future__ import annotations

from dflash_pipe import lazy_exports

_FROM = {
    ".codec": (
        "DEFAULT_MAX_TENSOR_BYTES",
        "DTYPES",
        "INLINE_MAX_BYTES",
        "decode",
        "dtype_from_name",
        "dtype_name",
        "encode",
    ),
    ".errors": (
        "BadMessage",
        "PeerGoneError",
        "ProtocolError",
        "ProtocolVersionError",
        "SendTimeoutError",
        "TransportError",
    ),
    ".messages": (
        "MESSAGE_TYPES",
        "PROTOCOL_VERSION",
        "Ack",
        "Batch",
        "Bye",
        "Checkpoint",
        "Done",
        "Error",
        "Heartbeat",
        "Hello",
        "Kind",
        "Message",
        "Metrics",
        "Plan",
        "Ready",
        "Redirect",
        "Reject",
        "Serving",
        "Welcome",
    ),
    ".transport": ("ProducerEndpoint", "WorkerEndpoint"),
}
_EXPORTS = {name: module for module, names in _FROM.items() for name in names}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
