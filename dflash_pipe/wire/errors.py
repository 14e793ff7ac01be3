"""Typed errors of the wire: malformed input is a `ProtocolError`, a peer that is gone is a `PeerGoneError`;
`field_error` rewords msgspec's validation errors as the `ProtocolError` peers get.

`ProtocolError` subclasses `ValueError` so message construction (which validates its fields) reads like any
other bad-argument error; the transport errors subclass `ConnectionError`.
"""

from __future__ import annotations

import re
import typing
from typing import Any

import msgspec


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


_AT = re.compile(r"(?P<what>.*?) - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`", re.S)
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]|\[\.\.\.\]")
_NOT_FOUND = object()


def field_error(
    cls: Any, data: bytes | memoryview, text: str, plain: msgspec.msgpack.Decoder
) -> ProtocolError:
    """msgspec's ValidationError `text` for message class `cls`, worded as peers have always been told
    (the field named, its value shown: `plain` decodes `data`, the field map, on this error path only)."""
    kind = cls.KIND.name
    at = _AT.fullmatch(text)
    what, path = (at["what"], at["path"]) if at else (text, "")
    if not path:
        if found := re.fullmatch(r"Object missing required field `(.+)`", what):
            return ProtocolError(f"{kind}: missing field(s) {[found[1]]}")
        if found := re.fullmatch(r"Object contains unknown field `(.+)`", what):
            return ProtocolError(f"{kind}: unknown field(s) {[found[1]]}")
        if found := re.fullmatch(r"Expected `object`, got `(\w+)`", what):
            return ProtocolError(f"{kind}: header 'f' must be a map, got {found[1]}")
    label = f"{cls.__name__}{path}" + (" key" if at and at["key"] else "")
    value = _NOT_FOUND if at and at["key"] else _value_at(data, path, plain)
    shown = "" if value is _NOT_FOUND else f" {value!r:.80}"
    if found := re.fullmatch(r"Expected `(.+?)`, got `(.+?)`", what):
        return ProtocolError(f"field {label!r}: expected {found[1]}, got {found[2]}{shown}")
    if what.startswith("Invalid enum value"):
        hint = typing.get_type_hints(cls).get(path.lstrip(".").split("[")[0])
        return ProtocolError(f"field {label!r}: {value!r:.40} is not one of {list(typing.get_args(hint))}")
    if found := re.fullmatch(r"Expected `(?:int|float)` (>=|>|<=|<) (\S+)", what):
        got = "NaN" if isinstance(value, float) and value != value else shown.strip()
        return ProtocolError(f"field {label!r}: must be {found[1]} {found[2]}, got {got}")
    return ProtocolError(f"field {label!r}: {what[:1].lower()}{what[1:]}{shown and ', got' + shown}")


def _value_at(data: bytes | memoryview, path: str, plain: msgspec.msgpack.Decoder) -> Any:
    """The value at a msgspec error path (``.lengths[1]``) of the raw field map, for the error text."""
    try:
        value = plain.decode(data)
    except (msgspec.DecodeError, ProtocolError, RecursionError):
        return _NOT_FOUND
    for name, index in ((m[1], m[2]) for m in _STEP.finditer(path)):
        try:
            value = value[name] if name else value[int(index)]
        except (KeyError, IndexError, TypeError, ValueError):
            return _NOT_FOUND
    return value
