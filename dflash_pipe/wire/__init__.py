"""Wire: the producer <-> worker protocol (ROUTER/DEALER, msgpack header + raw tensor frames).

``messages`` holds the message types and the protocol version, ``codec`` turns them into frames and back,
``transport`` owns the sockets and ``auth`` the CURVE key files (the only two modules that import zmq),
``addresses`` says which addresses need keys, ``slots``, ``ring``, ``shm`` and ``cuda_ipc`` hold the memory
payloads live in, ``fp8`` the feature encoding. It imports nothing else of the package: it is the bottom
layer. Non-loopback addresses need keys (``dflash-pipe keys generate DIR``); see docs/security.md.

The endpoints load on first use (PEP 562), so importing the codec or the messages (the run config does)
does not load pyzmq.
"""

from __future__ import annotations

from typing import Any

from dflash_pipe.wire.codec import (
    DEFAULT_MAX_TENSOR_BYTES,
    DTYPES,
    INLINE_MAX_BYTES,
    decode,
    dtype_from_name,
    dtype_name,
    encode,
)
from dflash_pipe.wire.errors import (
    BadMessage,
    PeerGoneError,
    ProtocolError,
    ProtocolVersionError,
    SendTimeoutError,
    TransportError,
)
from dflash_pipe.wire.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Ack,
    Batch,
    Bye,
    Checkpoint,
    Done,
    Error,
    Heartbeat,
    Hello,
    Kind,
    Message,
    Metrics,
    Ready,
    Reject,
    Welcome,
)

_ENDPOINTS = ("ProducerEndpoint", "WorkerEndpoint")


def __getattr__(name: str) -> Any:
    if name not in _ENDPOINTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from dflash_pipe.wire import transport

    value = getattr(transport, name)
    globals()[name] = value
    return value


__all__ = [
    "DEFAULT_MAX_TENSOR_BYTES",
    "DTYPES",
    "INLINE_MAX_BYTES",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "Ack",
    "BadMessage",
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
    "PeerGoneError",
    "ProducerEndpoint",
    "ProtocolError",
    "ProtocolVersionError",
    "Ready",
    "Reject",
    "SendTimeoutError",
    "TransportError",
    "Welcome",
    "WorkerEndpoint",
    "decode",
    "dtype_from_name",
    "dtype_name",
    "encode",
]
