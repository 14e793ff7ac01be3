"""Wire message types: one msgspec Struct per `Kind`, the kind -> class table and the protocol version.

Each message declares its fields' types and bounds (`Annotated[int, Meta(ge=0)]`); msgspec's typed msgpack
decoder checks them in C as a message arrives (`decode_fields`), and `encode_fields` runs the same decoder
over what it sends, so a message built wrong fails at its sender with the error its peer would give. Rules
across fields are each class's `_check`, run on construction and on decode. Every failure is a
`ProtocolError` naming the field: ``field 'Batch.batch_id': must be >= 0, got -1``.

Values are what msgpack carries without extensions (None, bool, int64/uint64, float, str, lists, str-keyed
maps); tensors travel only in a `tensors` field, filled by the codec from its tensor table, never in the
field map. Unknown fields are refused (`forbid_unknown_fields`): both sides speak one
`PROTOCOL_VERSION`, so an unknown field is a mismatch, not an extension to skip. A peer may leave out a
field that has a default. Decoded, an int in a float field is a float and an array a list.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, NoReturn

import msgspec
import torch
from msgspec import UNSET, Meta, UnsetType

from dflash_pipe.wire.errors import ProtocolError, field_error

PROTOCOL_VERSION = 7
"""Bumped on any change to the header layout, a kind's fields or their meaning (7: SERVING and REDIRECT,
and HELLO's "redirect" capability, so a worker is sent to the producer of its own node)."""

Role = Literal["worker", "producer"]
"""Who says HELLO: a drafter worker, or a producer attaching its target replicas to the run."""

REDIRECT_CAPABILITY = "redirect"
"""A HELLO capability: this worker follows a REDIRECT to the producer of its own node (not said by
``worker --no-redirect``, nor by a worker that already followed one: it goes at most once)."""

_MAX_PLAIN_DEPTH = 32  # nesting bound for free-form dict fields (drafter/train configs)

NonNegative = Annotated[int, Meta(ge=0)]
AtLeastOne = Annotated[int, Meta(ge=1)]
Seconds = Annotated[float, Meta(gt=0)]
Address = Annotated[str, Meta(min_length=7, max_length=1024, pattern=r"^(tcp|ipc)://[^\x00-\x20]+$")]
"""A ZeroMQ address a worker may connect to (tcp:// or ipc://, no spaces or control characters, bounded)."""
Name = Annotated[str, Meta(min_length=1, max_length=256)]
"""A worker's or producer's name (the dashboard's and the logs' key)."""
Tensors = dict[str, torch.Tensor]
"""Named tensors; on the wire, the header's tensor table (`wire.codec`), never its field map."""


class Kind(enum.IntEnum):
    """Message kind, sent as one byte (`k` in the header). Values are part of the protocol: never reuse."""

    HELLO = 0x01  # worker (or attaching producer) -> producer
    WELCOME = 0x02  # producer -> worker (or attaching producer)
    REJECT = 0x03  # producer -> worker
    READY = 0x04  # worker -> producer
    BATCH = 0x05  # producer -> worker
    # 0x06: unassigned (a worker without a batch simply waits for one; no message is needed)
    ACK = 0x07  # worker -> producer
    METRICS = 0x08  # worker rank 0 -> producer
    CHECKPOINT = 0x09  # worker rank 0 -> producer: written; producer -> workers: write one now (preemption)
    HEARTBEAT = 0x0A  # both ways
    ERROR = 0x0B  # either way
    DONE = 0x0C  # producer -> worker
    BYE = 0x0D  # worker -> producer
    PLAN = 0x0E  # coordinator -> attaching producer: the tokens of a batch to compute and serve
    SERVING = 0x0F  # attaching producer -> coordinator: the address its node's workers connect to
    REDIRECT = 0x10  # coordinator -> worker: join the producer on your own node instead


# ---------------------------------------------------------------------------------------------------------
# Base class and the checks msgspec's types do not say.


class Message(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of all wire messages: a keyword-only Struct bound to its `KIND`, listed in `MESSAGE_TYPES`.
    Subclasses say `kw_only=True` again (msgspec does not inherit it; `forbid_unknown_fields` it does)."""

    KIND: ClassVar[Kind]

    def __post_init__(self) -> None:  # msgspec calls it after __init__ and after a decode
        self._check()

    def _check(self) -> None:
        """Rules across fields; override in a subclass (raise `ProtocolError`)."""

    def check_tensors(self) -> None:
        """Rules between the fields and `tensors`; the codec calls it once it has attached the tensors."""


def _check_plain(value: Any, path: str, depth: int = 0) -> None:
    """A free-form value (drafter or train config) holds only plain msgpack values, nested boundedly."""
    if depth > _MAX_PLAIN_DEPTH:
        raise ProtocolError(f"field {path!r}: nested deeper than {_MAX_PLAIN_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ProtocolError(f"field '{path} key': expected str, got {type(k).__name__} {k!r:.40}")
            _check_plain(v, f"{path}.{k}", depth + 1)
        return
    raise ProtocolError(
        f"field {path!r}: expected None, bool, int, float, str, list or dict, got {type(value).__name__}"
    )


def _check_packed(msg: Batch | Plan) -> None:
    """One length per sample id (the tensors' shapes are `check_tensors`'s)."""
    if len(msg.sample_ids) != len(msg.lengths):
        raise ProtocolError(
            f"field '{type(msg).__name__}.lengths': {len(msg.lengths)} lengths for "
            f"{len(msg.sample_ids)} sample_ids"
        )


# ---------------------------------------------------------------------------------------------------------
# The messages (docs/architecture.md, "Wire", says what each is for).


class Hello(Message, kw_only=True):
    """Worker introduces itself; the producer answers WELCOME or REJECT."""

    KIND = Kind.HELLO
    worker_name: Name
    host: str
    pid: NonNegative
    device: str  # e.g. "cuda:0", "cpu"
    capabilities: list[str] = []  # "frames"; "shm"; "cuda_ipc" (a CUDA device); "redirect" (follows REDIRECT)
    host_id: str = ""  # wire.shm.host_identity(): equal on both sides means the ring can be shared
    protocol_version: NonNegative = PROTOCOL_VERSION
    role: Role = "worker"  # "producer": target replicas on another node that lease PLANs


class Welcome(Message, kw_only=True):
    """Everything a worker needs to build its drafter and join the run. Its rank is the drafters'
    rendezvous's to give, the drafter's shape is in ``drafter``, and fp8 features say so themselves (their
    ``feature_scales`` tensor), so none of those is repeated here."""

    KIND = Kind.WELCOME
    run_id: str
    rendezvous: str  # "tcp://host:port" for torch.distributed
    run_dir: str
    target_path: str
    drafter: dict[str, Any]  # DrafterConfig.to_dict()
    train: dict[str, Any]  # TrainConfig.to_dict(); the worker builds it with TrainConfig.from_dict
    resume_from: str | None = None
    heartbeat_s: Seconds
    peer_timeout_s: Seconds  # a peer silent this long is dead
    num_samples: AtLeastOne  # training samples per epoch (the ledger's size)
    credits: AtLeastOne  # batches the worker may hold at once (its first READY)
    eval_batches: NonNegative  # held-out eval BATCHes sent right after WELCOME
    eval_pending: bool = False  # the held-out set is still being regenerated: its BATCHes come later
    ring: dict[str, Any] = {}  # wire.shm.RingOffer for a same-host worker, or {}
    cuda_ring: dict[str, Any] = {}  # wire.cuda_ipc.CudaIpcOffer, or {}
    config: dict[str, Any] = {}  # to an attaching producer: RunConfig.to_dict()

    def _check(self) -> None:
        for name in ("drafter", "train", "ring", "cuda_ring", "config"):
            _check_plain(getattr(self, name), f"Welcome.{name}")


class Reject(Message, kw_only=True):
    """Handshake refused (version or config mismatch); the worker should exit with this reason."""

    KIND = Kind.REJECT
    reason: str


class Ready(Message, kw_only=True):
    """Credit-based flow: the worker accepts up to `credits` more BATCHes."""

    KIND = Kind.READY
    credits: AtLeastOne
    shm: bool = False  # the worker mapped the shm ring WELCOME offered: BATCH headers may name its slots
    cuda_ipc: bool = False  # the worker opened the CUDA IPC ring instead (said once, in the first READY)


class Batch(Message, kw_only=True):
    """Packed samples (back to back, `lengths` sum to T) and their target features.

    tensors: "input_ids" [T] int64|int32, "loss_mask" [T] bool|uint8, "features" [T, k*H] bf16|fp32, or
    with wire_dtype "fp8" float8_e4m3fn plus "feature_scales" [T, k] fp32 (see `wire.fp8`).
    Decoded tensors share the receive buffer (or the shared ring slot, valid until the ACK): `.clone()` or copy to device what you keep.
    Equality (`==`) is not meaningful for this class: compare tensors with `torch.equal`.
    """

    KIND = Kind.BATCH
    batch_id: NonNegative
    epoch: NonNegative
    sample_ids: list[NonNegative]
    lengths: list[NonNegative]
    tensors: Tensors | UnsetType = UNSET  # UNSET only while the codec decodes the header
    for_eval: bool = False  # held-out eval data (tensors also hold "target_next"); never leased or acked
    eval_set: NonNegative = 0  # for_eval: how many BATCHes the held-out set has

    def _check(self) -> None:
        if self.for_eval != (self.eval_set > 0):
            raise ProtocolError(
                f"field 'Batch.eval_set': {self.eval_set} with for_eval={self.for_eval} (an eval BATCH names "
                "the size of its held-out set, >= 1; a training BATCH has 0)"
            )
        _check_packed(self)
        if self.tensors is not UNSET:
            self.check_tensors()

    def check_tensors(self) -> None:
        ids = self.tensors.get("input_ids")
        if ids is not None and (ids.dim() != 1 or ids.shape[0] != sum(self.lengths)):
            raise ProtocolError(
                f"field 'Batch.tensors.input_ids': shape {tuple(ids.shape)} does not match "
                f"sum(lengths) = {sum(self.lengths)} (packed [T] expected)"
            )


class Plan(Message, kw_only=True):
    """A batch the coordinator leases to an attaching producer: the samples' tokens, packed as in BATCH, for
    its target to turn into features for the workers of its own node (features never cross nodes). Leased
    like a BATCH to a worker: its ACK comes back through that producer; a producer that is lost gives its
    PLANs back. ``eval_set`` > 0: one of the held-out set's PLANs (never acked), which it turns into eval
    BATCHes."""

    KIND = Kind.PLAN
    batch_id: NonNegative
    epoch: NonNegative
    sample_ids: list[NonNegative]
    lengths: list[AtLeastOne]
    tensors: Tensors | UnsetType = UNSET  # "input_ids" [T] int64, "loss_mask" [T] uint8
    eval_set: NonNegative = 0

    def _check(self) -> None:
        _check_packed(self)
        if self.tensors is not UNSET:
            self.check_tensors()

    def check_tensors(self) -> None:
        for name in ("input_ids", "loss_mask"):
            t = self.tensors.get(name)
            if t is None or t.dim() != 1 or t.shape[0] != sum(self.lengths):
                shape = None if t is None else tuple(t.shape)
                raise ProtocolError(
                    f"field 'Plan.tensors.{name}': shape {shape}, expected [{sum(self.lengths)}] (sum of lengths)"
                )


class Serving(Message, kw_only=True):
    """An attaching producer answers its node's workers at ``address`` (sent once its loop serves them).
    The coordinator sends a worker of that node there (REDIRECT), so its features never cross nodes."""

    KIND = Kind.SERVING
    address: Address


class Redirect(Message, kw_only=True):
    """Instead of WELCOME: producer ``producer`` of the run runs on the worker's own node and serves at
    ``address``; the worker closes this link and says HELLO there (without the "redirect" capability: a
    redirect never bounces). No WELCOME from there within ``timeout_s`` (the producer died meanwhile):
    the worker comes back here, again without "redirect", and is fed over the network."""

    KIND = Kind.REDIRECT
    producer: Name
    address: Address
    timeout_s: Seconds


class Ack(Message, kw_only=True):
    """The worker finished these batches (their leases end) at optimizer step `step`."""

    KIND = Kind.ACK
    batch_ids: list[NonNegative]
    step: NonNegative


class Metrics(Message, kw_only=True):
    """Training metrics from worker rank 0, for the producer's logger."""

    KIND = Kind.METRICS
    step: NonNegative
    values: dict[str, float | list[float]]


class Checkpoint(Message, kw_only=True):
    """Worker rank 0 wrote a checkpoint at `path`. From the producer (``path`` empty): write one at the next
    step boundary and train on (a preemption warning)."""

    KIND = Kind.CHECKPOINT
    step: NonNegative
    path: str


class Heartbeat(Message, kw_only=True):
    """Liveness, both ways; `time` is the sender's `time.time()`."""

    KIND = Kind.HEARTBEAT
    time: float


class Error(Message, kw_only=True):
    """A dying peer says why (this is a message, not an exception)."""

    KIND = Kind.ERROR
    source: str  # e.g. "worker rank 3 (host:pid)"
    message: str
    traceback: str = ""


class Done(Message, kw_only=True):
    """Training finished (all epochs acked) or shutdown requested; the worker should leave."""

    KIND = Kind.DONE
    reason: str
    evaluate: bool = True  # run the final evaluation; False on a signal's drain (checkpoint and leave fast)


class Bye(Message, kw_only=True):
    """The worker leaves cleanly; its leases (if any) go back to the queue."""

    KIND = Kind.BYE
    reason: str


_CLASSES = (
    Hello, Welcome, Reject, Ready, Batch, Ack, Metrics, Checkpoint, Heartbeat, Error, Done, Bye, Plan, Serving,
    Redirect,
)  # fmt: skip
MESSAGE_TYPES: Mapping[Kind, type[Message]] = types.MappingProxyType({cls.KIND: cls for cls in _CLASSES})
"""Kind -> message class. The only dispatch table: the codec looks kinds up here, never by name."""
if len(MESSAGE_TYPES) != len(_CLASSES):
    raise TypeError("two message classes share a Kind")


def has_tensors(cls: type[Message]) -> bool:
    return "tensors" in cls.__struct_fields__


# ---------------------------------------------------------------------------------------------------------
# The field map `f` of a header <-> a message, through msgspec's typed msgpack decoders.


def refuse_ext(code: int, data: memoryview) -> NoReturn:
    """msgspec's `ext_hook`: no extension type is ever decoded (nothing but msgpack crosses the wire)."""
    raise ProtocolError(f"msgpack extension type {code} is not allowed in a wire header (max_ext_len is 0)")


def _refuse_tensor(tp: type, obj: Any) -> NoReturn:
    raise TypeError("tensors travel in the header's tensor table 't', not in its field map 'f'")


ENCODER = msgspec.msgpack.Encoder()
"""The one msgpack encoder of the wire (the field map here, the header in the codec)."""
_DECODERS = {
    kind: msgspec.msgpack.Decoder(cls, dec_hook=_refuse_tensor, ext_hook=refuse_ext)
    for kind, cls in MESSAGE_TYPES.items()
}
PLAIN = msgspec.msgpack.Decoder(ext_hook=refuse_ext)
"""Untyped msgpack values, extension types refused (header values, error texts)."""


def encode_fields(msg: Message) -> bytes:
    """The msgpack map of `msg`'s fields (all but `tensors`), checked as its peer will check it."""
    cls = type(msg)
    if MESSAGE_TYPES.get(getattr(cls, "KIND", None)) is not cls:
        raise ProtocolError(f"cannot encode {cls.__name__}: not a registered wire message")
    fields: Any = msg
    if has_tensors(cls):
        fields = msgspec.structs.asdict(msg)
        del fields["tensors"]
    try:
        data = ENCODER.encode(fields)
    except OverflowError as e:
        raise ProtocolError(f"cannot encode {cls.__name__}: {e} (msgpack carries int64/uint64)") from None
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"cannot encode {cls.__name__}: {e}") from None
    decode_fields(cls.KIND, data)
    return data


def decode_fields(kind: Kind, data: bytes | memoryview) -> Message:
    """The message of `kind` from its msgpack field map, every type and bound checked (tensors UNSET)."""
    try:
        msg = _DECODERS[kind].decode(data)
    except msgspec.ValidationError as e:
        if isinstance(e.__cause__, ProtocolError):  # a `_check` rule, run by msgspec after the types
            raise e.__cause__ from None
        raise field_error(MESSAGE_TYPES[kind], data, str(e), PLAIN) from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"{kind.name}: header 'f' is not valid msgpack: {e}") from None
    except RecursionError:
        raise ProtocolError(f"{kind.name}: header 'f' is nested too deeply") from None
    if getattr(msg, "tensors", UNSET) is not UNSET:
        raise ProtocolError(f"{kind.name}: unknown field(s) ['tensors'] (tensors travel in the tensor table)")
    return msg
