"""Wire: the producer <-> worker protocol (ROUTER/DEALER, msgpack header + raw tensor frames).

``messages`` holds the message types and the protocol version, ``codec`` turns them into frames and back,
``transport`` owns the sockets and ``auth`` the CURVE key files (the only two modules that import zmq).
Non-loopback addresses need keys (``dflash-pipe keys generate DIR``); see docs/security.md.
"""

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
from dflash_pipe.wire.transport import ProducerEndpoint, WorkerEndpoint

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
