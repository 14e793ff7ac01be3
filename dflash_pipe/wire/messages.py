"""Wire message types: one dataclass per `Kind`, a kind <-> class registry and the protocol version.

Every message validates its own fields in `__post_init__` (type, range, cross-field rules) and raises
`ProtocolError` naming the field. The codec decodes a header into a plain dict and constructs the class, so
the same checks guard both a message built in-process and one that arrived from a peer. The checks are
derived once per class from its annotations plus optional `field(metadata=...)` bounds (`ge`, `gt`, `le`;
on a list they bound every element), so adding a field or a range is a one-line change.

Field values are restricted to what msgpack carries without extensions: None, bool, int (int64/uint64),
float, str, lists and str-keyed dicts of those; tensors travel only in a `tensors: dict[str, Tensor]` field.
Tuples are accepted and normalized to lists, ints in float fields to floats, so a decoded message compares
equal to the one that was sent.

Past 400 lines because every message of the protocol and the field checks they share are one schema, read
top to bottom.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch

from dflash_pipe.wire.errors import ProtocolError

PROTOCOL_VERSION = 6
"""Bumped on any change to the header layout, a kind's fields or their meaning."""

ROLES = ("worker", "producer")
"""Who says HELLO: a drafter worker, or a producer attaching its target replicas to the run."""

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what msgpack can carry
_MAX_JSON_DEPTH = 32  # nesting bound for free-form dict fields (drafter/train configs)


"""How features travel: in the target's dtype, or float8_e4m3fn with a per token-layer scale."""


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


# ---------------------------------------------------------------------------------------------------------
# Per-field checkers, compiled once per class from the annotations.

Checker = Callable[[Any, str], Any]  # (value, field path) -> normalized value; raises ProtocolError


def _fail(path: str, expected: str, value: Any) -> typing.NoReturn:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise ProtocolError(f"field {path!r}: expected {expected}, got {type(value).__name__} {shown}")


def _check_int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(path, "int", value)
    if not _INT_MIN <= value <= _INT_MAX:
        _fail(path, "an int within int64/uint64", value)
    return int(value)


def _check_float(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(path, "float", value)
    return float(value)


def _check_str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        _fail(path, "str", value)
    return value


def _check_bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        _fail(path, "bool", value)
    return value


def _check_none(value: Any, path: str) -> None:
    if value is not None:
        _fail(path, "None", value)


def _check_tensor(value: Any, path: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        _fail(path, "torch.Tensor", value)
    return value


def _check_json(value: Any, path: str, depth: int = 0) -> Any:
    """A msgpack-safe plain value (for free-form dicts such as the drafter config); tuples become lists."""
    if depth > _MAX_JSON_DEPTH:
        raise ProtocolError(f"field {path!r}: nested deeper than {_MAX_JSON_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return _check_int(value, path)
    if isinstance(value, float):
        return value
    if isinstance(value, (list, tuple)):
        return [_check_json(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                _fail(f"{path} key", "str", k)
            out[k] = _check_json(v, f"{path}.{k}", depth + 1)
        return out
    _fail(path, "None, bool, int, float, str, list or dict", value)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is None and isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _compile(tp: Any) -> Checker:
    """Build a checker for an annotation; only the small vocabulary the protocol uses is supported."""
    simple = {
        int: _check_int,
        float: _check_float,
        str: _check_str,
        bool: _check_bool,
        type(None): _check_none,
        torch.Tensor: _check_tensor,
    }
    if tp in simple:
        return simple[tp]
    if tp is Any:
        return _check_json
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        item = _compile(args[0])

        def check_list(value: Any, path: str) -> list:
            if not isinstance(value, (list, tuple)):
                _fail(path, _type_name(tp), value)
            return [item(v, f"{path}[{i}]") for i, v in enumerate(value)]

        return check_list
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"wire dict fields need str keys, got {tp!r}")
        val = _compile(args[1])

        def check_dict(value: Any, path: str) -> dict:
            if not isinstance(value, dict):
                _fail(path, _type_name(tp), value)
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    _fail(f"{path} key", "str", k)
                out[k] = val(v, f"{path}.{k}")
            return out

        return check_dict
    if origin in (typing.Union, types.UnionType):
        alternatives = [_compile(a) for a in args]

        def check_union(value: Any, path: str) -> Any:
            for alt in alternatives:
                try:
                    return alt(value, path)
                except ProtocolError:
                    continue
            _fail(path, _type_name(tp), value)

        return check_union
    raise TypeError(f"unsupported wire field type {tp!r}")


def _bound(value: Any, path: str, meta: Mapping[str, Any]) -> None:
    """Apply `ge`/`gt`/`le` bounds from field metadata; on a list, to every element."""
    if isinstance(value, list):
        for i, v in enumerate(value):
            _bound(v, f"{path}[{i}]", meta)
        return
    if not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and math.isnan(value) and meta:
        raise ProtocolError(f"field {path!r}: NaN where a bounded number is required")
    if "ge" in meta and not value >= meta["ge"]:
        raise ProtocolError(f"field {path!r}: must be >= {meta['ge']}, got {value!r}")
    if "gt" in meta and not value > meta["gt"]:
        raise ProtocolError(f"field {path!r}: must be > {meta['gt']}, got {value!r}")
    if "le" in meta and not value <= meta["le"]:
        raise ProtocolError(f"field {path!r}: must be <= {meta['le']}, got {value!r}")


def bounded(*, ge: float | None = None, gt: float | None = None, le: float | None = None, **kw: Any) -> Any:
    """`dataclasses.field` with numeric bounds checked on construction and on decode."""
    meta = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le)) if v is not None}
    return field(metadata=meta, **kw)


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """How one message field is checked: its compiled type checker and numeric bounds."""

    name: str
    check: Checker
    bounds: Mapping[str, Any]


# ---------------------------------------------------------------------------------------------------------
# Base class and registry.


class Message:
    """Base of all wire messages. Subclasses are registered with `@register(Kind.X)` and are
    `@dataclass(kw_only=True, slots=True)`; construction validates every field."""

    __slots__ = ()
    KIND: ClassVar[Kind]
    SCHEMA: ClassVar[tuple[FieldSpec, ...]]

    def __post_init__(self) -> None:
        name = type(self).__name__
        for spec in self.SCHEMA:
            path = f"{name}.{spec.name}"
            value = spec.check(getattr(self, spec.name), path)
            _bound(value, path, spec.bounds)
            object.__setattr__(self, spec.name, value)
        self._check()

    def _check(self) -> None:
        """Cross-field rules; override in a subclass (raise `ProtocolError`)."""


M = TypeVar("M", bound=type[Message])

_REGISTRY: dict[Kind, type[Message]] = {}
MESSAGE_TYPES: Mapping[Kind, type[Message]] = types.MappingProxyType(_REGISTRY)
"""Kind -> message class. The only dispatch table: the codec looks kinds up here, never by name."""


def register(kind: Kind) -> Callable[[M], M]:
    """Class decorator: bind a message dataclass to its kind and compile its field schema."""

    def wrap(cls: M) -> M:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__}: apply @register above @dataclass")
        if kind in _REGISTRY:
            raise TypeError(f"{kind!r} is already bound to {_REGISTRY[kind].__name__}")
        hints = typing.get_type_hints(cls)
        cls.KIND = kind
        cls.SCHEMA = tuple(
            FieldSpec(name=f.name, check=_compile(hints[f.name]), bounds=dict(f.metadata))
            for f in dataclasses.fields(cls)
        )
        _REGISTRY[kind] = cls
        return cls

    return wrap


def field_names(cls: type[Message]) -> tuple[str, ...]:
    """Names of the header fields of a message class (everything but `tensors`)."""
    return tuple(s.name for s in cls.SCHEMA if s.name != "tensors")


def has_tensors(cls: type[Message]) -> bool:
    return any(s.name == "tensors" for s in cls.SCHEMA)


# ---------------------------------------------------------------------------------------------------------
# The messages (docs/architecture.md, "Wire", says what each is for).


@register(Kind.HELLO)
@dataclass(kw_only=True, slots=True)
class Hello(Message):
    """Worker introduces itself; the producer answers WELCOME or REJECT."""

    worker_name: str
    host: str
    pid: int = bounded(ge=0)
    device: str  # e.g. "cuda:0", "cpu"
    capabilities: list[str] = field(default_factory=list)  # "frames"; "shm"; "cuda_ipc" (a CUDA device)
    host_id: str = ""  # wire.shm.host_identity(): equal on both sides means the ring can be shared
    protocol_version: int = bounded(ge=0, default=PROTOCOL_VERSION)
    role: str = "worker"  # "worker", or "producer": target replicas on another node that lease PLANs

    def _check(self) -> None:
        if self.role not in ROLES:
            raise ProtocolError(f"field 'Hello.role': {self.role!r} is not one of {list(ROLES)}")


@register(Kind.WELCOME)
@dataclass(kw_only=True, slots=True)
class Welcome(Message):
    """Everything a worker needs to build its drafter and join the run. Its rank is the drafters'
    rendezvous's to give, the drafter's shape is in ``drafter``, and fp8 features say so themselves (their
    ``feature_scales`` tensor), so none of those is repeated here."""

    run_id: str
    rendezvous: str  # "tcp://host:port" for torch.distributed
    run_dir: str
    target_path: str
    drafter: dict[str, Any]  # DrafterConfig.to_dict()
    train: dict[str, Any]  # TrainConfig.to_dict(); the worker builds it with TrainConfig.from_dict
    resume_from: str | None = None
    heartbeat_s: float = bounded(gt=0)
    peer_timeout_s: float = bounded(gt=0)  # a peer silent this long is dead
    num_samples: int = bounded(ge=1)  # training samples per epoch (the ledger's size)
    credits: int = bounded(ge=1)  # batches the worker may hold at once (its first READY)
    eval_batches: int = bounded(ge=0)  # held-out eval BATCHes sent right after WELCOME
    eval_pending: bool = False  # the held-out set is still being regenerated: its BATCHes come later
    ring: dict[str, Any] = field(default_factory=dict)  # wire.shm.RingOffer for a same-host worker, or {}
    cuda_ring: dict[str, Any] = field(default_factory=dict)  # wire.cuda_ipc.CudaIpcOffer, or {}
    config: dict[str, Any] = field(default_factory=dict)  # to an attaching producer: RunConfig.to_dict()


@register(Kind.REJECT)
@dataclass(kw_only=True, slots=True)
class Reject(Message):
    """Handshake refused (version or config mismatch); the worker should exit with this reason."""

    reason: str


@register(Kind.READY)
@dataclass(kw_only=True, slots=True)
class Ready(Message):
    """Credit-based flow: the worker accepts up to `credits` more BATCHes."""

    credits: int = bounded(ge=1)
    shm: bool = False  # the worker mapped the shm ring WELCOME offered: BATCH headers may name its slots
    cuda_ipc: bool = False  # the worker opened the CUDA IPC ring instead (said once, in the first READY)


@register(Kind.BATCH)
@dataclass(kw_only=True, slots=True)
class Batch(Message):
    """Packed samples (back to back, `lengths` sum to T) and their target features.

    tensors: "input_ids" [T] int64|int32, "loss_mask" [T] bool|uint8, "features" [T, k*H] bf16|fp32, or
    with wire_dtype "fp8" float8_e4m3fn plus "feature_scales" [T, k] fp32 (see `wire.fp8`).
    Decoded tensors share the receive buffer (or the shared ring slot, valid until the ACK): `.clone()` or copy to device what you keep.
    Equality (`==`) is not meaningful for this class: compare tensors with `torch.equal`.
    """

    batch_id: int = bounded(ge=0)
    epoch: int = bounded(ge=0)
    sample_ids: list[int] = bounded(ge=0)
    lengths: list[int] = bounded(ge=0)
    tensors: dict[str, torch.Tensor]
    for_eval: bool = False  # held-out eval data (tensors also hold "target_next"); never leased or acked
    eval_set: int = bounded(ge=0, default=0)  # for_eval: how many BATCHes the held-out set has

    def _check(self) -> None:
        if self.for_eval != (self.eval_set > 0):
            raise ProtocolError(
                f"field 'Batch.eval_set': {self.eval_set} with for_eval={self.for_eval} (an eval BATCH names "
                "the size of its held-out set, >= 1; a training BATCH has 0)"
            )
        if len(self.sample_ids) != len(self.lengths):
            raise ProtocolError(
                f"field 'Batch.lengths': {len(self.lengths)} lengths for {len(self.sample_ids)} sample_ids"
            )
        ids = self.tensors.get("input_ids")
        if ids is not None and (ids.dim() != 1 or ids.shape[0] != sum(self.lengths)):
            raise ProtocolError(
                f"field 'Batch.tensors.input_ids': shape {tuple(ids.shape)} does not match "
                f"sum(lengths) = {sum(self.lengths)} (packed [T] expected)"
            )


@register(Kind.PLAN)
@dataclass(kw_only=True, slots=True)
class Plan(Message):
    """A batch the coordinator leases to an attaching producer: the samples' tokens, packed as in BATCH, for
    its target to turn into features for the workers of its own node (features never cross nodes). Leased
    like a BATCH to a worker: its ACK comes back through that producer; a producer that is lost gives its
    PLANs back. ``eval_set`` > 0: one of the held-out set's PLANs (never acked), which it turns into eval
    BATCHes."""

    batch_id: int = bounded(ge=0)
    epoch: int = bounded(ge=0)
    sample_ids: list[int] = bounded(ge=0)
    lengths: list[int] = bounded(ge=1)
    tensors: dict[str, torch.Tensor]  # "input_ids" [T] int64, "loss_mask" [T] uint8
    eval_set: int = bounded(ge=0, default=0)

    def _check(self) -> None:
        if len(self.sample_ids) != len(self.lengths):
            raise ProtocolError(
                f"field 'Plan.lengths': {len(self.lengths)} lengths for {len(self.sample_ids)} sample_ids"
            )
        for name in ("input_ids", "loss_mask"):
            t = self.tensors.get(name)
            if t is None or t.dim() != 1 or t.shape[0] != sum(self.lengths):
                shape = None if t is None else tuple(t.shape)
                raise ProtocolError(
                    f"field 'Plan.tensors.{name}': shape {shape}, expected [{sum(self.lengths)}] (sum of lengths)"
                )


@register(Kind.ACK)
@dataclass(kw_only=True, slots=True)
class Ack(Message):
    """The worker finished these batches (their leases end) at optimizer step `step`."""

    batch_ids: list[int] = bounded(ge=0)
    step: int = bounded(ge=0)


@register(Kind.METRICS)
@dataclass(kw_only=True, slots=True)
class Metrics(Message):
    """Training metrics from worker rank 0, for the producer's logger."""

    step: int = bounded(ge=0)
    values: dict[str, float | list[float]]


@register(Kind.CHECKPOINT)
@dataclass(kw_only=True, slots=True)
class Checkpoint(Message):
    """Worker rank 0 wrote a checkpoint at `path`. From the producer (``path`` empty): write one at the next
    step boundary and train on (a preemption warning)."""

    step: int = bounded(ge=0)
    path: str


@register(Kind.HEARTBEAT)
@dataclass(kw_only=True, slots=True)
class Heartbeat(Message):
    """Liveness, both ways; `time` is the sender's `time.time()`."""

    time: float


@register(Kind.ERROR)
@dataclass(kw_only=True, slots=True)
class Error(Message):
    """A dying peer says why (this is a message, not an exception)."""

    source: str  # e.g. "worker rank 3 (host:pid)"
    message: str
    traceback: str = ""


@register(Kind.DONE)
@dataclass(kw_only=True, slots=True)
class Done(Message):
    """Training finished (all epochs acked) or shutdown requested; the worker should leave."""

    reason: str
    evaluate: bool = True  # run the final evaluation; False on a signal's drain (checkpoint and leave fast)


@register(Kind.BYE)
@dataclass(kw_only=True, slots=True)
class Bye(Message):
    """The worker leaves cleanly; its leases (if any) go back to the queue."""

    reason: str
