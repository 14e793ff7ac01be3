"""Message <-> frames: `[msgpack header, *raw tensor frames]`, zero-copy both ways, strict on decode.

Header (frame 0, a msgpack map with exactly these keys):
    v: protocol version (int)      k: kind byte (int)
    f: the message fields, except `tensors` (map str -> value)
    t: tensor table, a list of [name, dtype, shape, loc]; loc says where the tensor's bytes are:
       - bytes: inline, for tensors of at most `INLINE_MAX_BYTES`;
       - int i: raw frame i (frames 1..N, each used by exactly one tensor);
       - [i, n] (n >= 2): the n raw frames i..i+n-1 back to back (a tensor over `frame_bytes`, sent as
         frames of that size: pyzmq moves a few MiB per frame several times faster than one huge frame);
       - {"s": slot, "o": offset}: in slot `slot` of the ring the handshake set up for this peer (host
         shared memory, `wire.shm`, or one GPU allocation, `wire.cuda_ipc`), `offset` bytes in. No frame:
         the bytes never cross the socket.

Zero-copy rules:
- `encode` returns memoryviews of the tensors' own storage (non-contiguous tensors are made contiguous
  first, which copies). The views keep the tensors alive; do not modify a tensor in place until the send
  is done (`ProducerEndpoint.send(..., track=True)` gives a tracker to wait on).
- `decode` returns tensors that are views of the received frame buffers (zmq frames are writable). A
  read-only buffer (e.g. `bytes`) is copied into a `bytearray` first: a tensor over immutable memory
  would let in-place ops corrupt it, and torch warns about it. The transport never hands read-only
  buffers, so the socket path stays zero-copy. Callers `.clone()` or copy to device what they keep.
- A raw frame whose address is not aligned to the element size is copied (torch kernels assume alignment).
- A tensor sent in several frames is reassembled by copying each frame into its slice of one buffer from
  `alloc` (pinned host memory on a CUDA worker, so the host-to-device copy that follows is async; or a
  device tensor, which then receives each frame straight from the zmq buffer): one copy per byte.
- A tensor in a ring slot is a view of the shared mapping (a CUDA tensor for the CUDA IPC ring), valid
  until the batch is ACKed (the producer reuses the slot after that): copy it to the device before
  acknowledging. Encoding sends a CUDA tensor only by reference: one outside the ring is an error.

Every size the header declares is checked against the frames and against `max_tensor_bytes` before any
tensor is built. msgspec reads the header: a map of str keys whose values are decoded one by one, `f` by the
kind's typed decoder (`messages.decode_fields`); no extension type is accepted anywhere. Nothing but msgpack
and raw bytes ever crosses the wire.

Past 400 lines because the encoder and the decoder of one format stay together: every check on decode
answers a step of encode.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import msgspec
import numpy as np
import torch

from dflash_pipe.wire.errors import ProtocolError, ProtocolVersionError
from dflash_pipe.wire.messages import (
    ENCODER,
    MESSAGE_TYPES,
    PLAIN,
    PROTOCOL_VERSION,
    Kind,
    Message,
    decode_fields,
    encode_fields,
    has_tensors,
)

INLINE_MAX_BYTES = 1023
"""Tensors of at most this many bytes travel inside the header (no frame of their own)."""
DEFAULT_MAX_TENSOR_BYTES = 8 << 30
"""Default cap on the total tensor bytes one message may declare (8 GiB)."""
MAX_HEADER_BYTES = 16 << 20
"""Cap on the header frame (sample ids, configs, tracebacks fit easily)."""
MAX_RANK = 8
MAX_TENSORS = 64
"""Cap on the tensors of one message; a BATCH carries 3-5."""
MAX_FRAMES = 1 << 16
"""Cap on the raw frames of one message (8 GiB in 128 KiB frames)."""
MIN_FRAME_BYTES = 64 << 10
"""Smallest `frame_bytes` accepted: smaller frames only add per-frame overhead."""

_NAMES = (
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "float8_e4m3fn",
)
DTYPES: Mapping[str, torch.dtype] = {n: getattr(torch, n) for n in _NAMES if hasattr(torch, n)}
"""Allow-list of tensor dtypes on the wire, by the name used in the header (torch's own names)."""
_DTYPE_NAMES = {dt: n for n, dt in DTYPES.items()}
_HEADER_KEYS = frozenset("vkft")
_HEADER = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])

Frame = bytes | bytearray | memoryview  # or anything with the buffer protocol (zmq.Frame)
Alloc = Callable[[int], torch.Tensor]
"""nbytes -> a uint8 tensor of that many bytes (host or device) where a multi-frame tensor is reassembled."""


class SharedRing(Protocol):
    """What the codec needs of a payload ring (`wire.shm.ShmRing`, `wire.cuda_ipc.CudaIpcRing`)."""

    slots: int
    slot_bytes: int

    def locate(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """(slot, offset) of a contiguous tensor lying wholly inside one slot (on the ring's device), else
        None."""
        ...

    def view(self, slot: int, offset: int, nbytes: int) -> torch.Tensor:
        """uint8 [nbytes] view of the mapping (the caller checked the bounds)."""
        ...


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype (e.g. "bfloat16"); raises `ProtocolError` for dtypes not on the wire."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ProtocolError(f"dtype {dtype} cannot travel on the wire; allowed: {sorted(DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of `dtype_name`."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ProtocolError(f"dtype {name!r} is not allowed on the wire; allowed: {sorted(DTYPES)}") from None


# ---------------------------------------------------------------------------------------------------------
# encode


def _tensor_bytes(name: str, tensor: torch.Tensor) -> memoryview:
    """A flat byte view of the tensor's storage (copies only if it is not contiguous)."""
    if tensor.layout != torch.strided:
        raise ProtocolError(f"tensor {name!r}: layout {tensor.layout} cannot travel; send a dense tensor")
    if tensor.device.type != "cpu":
        raise ProtocolError(
            f"tensor {name!r} is on {tensor.device} outside the peer's ring; copy it to (pinned) CPU memory first"
        )
    flat = tensor.detach().contiguous().reshape(-1)  # [numel]
    # numpy has no bf16/fp8: reinterpret as bytes, which also makes 0-d and bool tensors uniform.
    return memoryview(flat.view(torch.uint8).numpy())


def _frame_locs(data: memoryview, frames: list, frame_bytes: int | None) -> int | list[int]:
    """Appends `data` as one frame, or as frames of `frame_bytes` (views, no copy); returns its loc."""
    first = len(frames)
    if frame_bytes is None or data.nbytes <= frame_bytes:
        frames.append(data)
        return first
    frames.extend(data[i : i + frame_bytes] for i in range(0, data.nbytes, frame_bytes))
    if len(frames) > 1 + MAX_FRAMES:
        raise ProtocolError(
            f"{len(frames) - 1} frames of {frame_bytes} bytes exceed the cap of {MAX_FRAMES}; "
            "raise wire.frame_bytes"
        )
    return [first, len(frames) - first]


def encode(
    msg: Message, *, frame_bytes: int | None = None, ring: SharedRing | None = None
) -> list[bytes | memoryview]:
    """Frames for `msg`: the msgpack header, then the raw frames of every tensor over `INLINE_MAX_BYTES`.

    `frame_bytes`: tensors larger than this go as several frames of this size (None: one frame each).
    `ring`: tensors lying in one of its slots go by reference (slot, offset) instead of as frames; only
    for a peer that mapped the same ring.
    """
    if frame_bytes is not None and frame_bytes < MIN_FRAME_BYTES:
        raise ValueError(f"frame_bytes={frame_bytes} is below the minimum of {MIN_FRAME_BYTES}")
    cls = type(msg)
    fields = encode_fields(msg)  # refuses an unregistered class, checks every field
    table: list[list[Any]] = []
    frames: list[bytes | memoryview] = [b""]  # header goes in slot 0 once the table is complete
    if has_tensors(cls):
        if not isinstance(msg.tensors, dict):
            raise ProtocolError(f"field '{cls.__name__}.tensors': expected dict[str, torch.Tensor]")
        if len(msg.tensors) > MAX_TENSORS:
            raise ProtocolError(f"{cls.__name__}: {len(msg.tensors)} tensors, over the cap of {MAX_TENSORS}")
        for name, tensor in msg.tensors.items():
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise ProtocolError(
                    f"field '{cls.__name__}.tensors.{name}': expected a torch.Tensor named by a str, "
                    f"got {type(tensor).__name__}"
                )
            if tensor.dim() > MAX_RANK:
                raise ProtocolError(f"tensor {name!r}: rank {tensor.dim()} exceeds {MAX_RANK}")
            where = ring.locate(tensor) if ring is not None else None
            if where is not None:
                loc: Any = {"s": where[0], "o": where[1]}
                table.append([name, dtype_name(tensor.dtype), list(tensor.shape), loc])
                continue
            data = _tensor_bytes(name, tensor)
            if data.nbytes <= INLINE_MAX_BYTES:
                loc = data.tobytes()
            else:
                loc = _frame_locs(data, frames, frame_bytes)
            table.append([name, dtype_name(tensor.dtype), list(tensor.shape), loc])
    header = {"v": PROTOCOL_VERSION, "k": int(cls.KIND), "f": msgspec.Raw(fields), "t": table}
    frames[0] = ENCODER.encode(header)
    return frames


# ---------------------------------------------------------------------------------------------------------
# decode


def _unpack_header(buf: memoryview, max_header_bytes: int) -> dict[str, msgspec.Raw]:
    """The header's top-level map, each value still msgpack bytes (a `msgspec.Raw`)."""
    if buf.nbytes == 0:
        raise ProtocolError("empty header frame")
    if buf.nbytes > max_header_bytes:
        raise ProtocolError(f"header frame of {buf.nbytes} bytes exceeds the {max_header_bytes}-byte cap")
    try:
        return _HEADER.decode(buf)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"header must be a msgpack map with str keys: {e}") from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise ProtocolError(f"header frame is not valid msgpack: {type(e).__name__}: {e}") from None


def _plain(raw: msgspec.Raw | None, what: str) -> Any:
    """One header value as plain msgpack data (no extension types); None when the key is absent."""
    if raw is None:
        return None
    try:
        return PLAIN.decode(raw)
    except ProtocolError as e:  # an extension type
        raise ProtocolError(f"header frame is not valid msgpack: {what}: {e}") from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise ProtocolError(f"header frame is not valid msgpack: {what}: {type(e).__name__}: {e}") from None


def _as_bytes_view(frame: Any, index: int) -> memoryview:
    try:
        view = memoryview(frame)
    except TypeError:
        raise ProtocolError(f"frame {index} is a {type(frame).__name__}, not a buffer") from None
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def _check_entry(entry: Any, i: int) -> tuple[str, torch.dtype, list[int], Any, int]:
    """Validate one tensor-table entry; returns (name, dtype, shape, loc, nbytes)."""
    if not isinstance(entry, list) or len(entry) != 4:
        raise ProtocolError(f"tensor table entry {i} must be [name, dtype, shape, loc], got {entry!r:.80}")
    name, dtype, shape, loc = entry
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"tensor table entry {i}: name must be a non-empty str, got {name!r:.80}")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ProtocolError(f"tensor {name!r}: dtype {dtype!r:.40} is not allowed; allowed: {sorted(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        raise ProtocolError(f"tensor {name!r}: shape must be a list of at most {MAX_RANK} ints")
    if not all(type(d) is int and d >= 0 for d in shape):
        raise ProtocolError(f"tensor {name!r}: shape {shape!r:.80} must hold non-negative ints")
    if isinstance(loc, list):
        if len(loc) != 2 or not all(type(v) is int for v in loc) or loc[1] < 2:
            raise ProtocolError(f"tensor {name!r}: frame range must be [first, count >= 2], got {loc!r:.40}")
    elif isinstance(loc, dict):
        if loc.keys() != {"s", "o"} or not all(type(v) is int and v >= 0 for v in loc.values()):
            raise ProtocolError(
                f"tensor {name!r}: a ring location must be {{'s': slot, 'o': offset}} of non-negative "
                f"ints, got {loc!r:.60}"
            )
    elif isinstance(loc, bytes):
        if len(loc) > INLINE_MAX_BYTES:
            raise ProtocolError(f"tensor {name!r}: {len(loc)} inline bytes, over {INLINE_MAX_BYTES}")
    elif type(loc) is not int:
        raise ProtocolError(
            f"tensor {name!r}: loc must be a frame index, a frame range, a ring location or inline bytes, "
            f"got {loc!r:.40}"
        )
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize  # Python ints: no overflow
    return name, DTYPES[dtype], shape, loc, nbytes


def _to_tensor(buf: memoryview | bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A tensor over `buf` (zero-copy when it is writable and aligned)."""
    if len(buf) == 0:
        return torch.empty(shape, dtype=dtype)  # frombuffer refuses empty buffers
    if isinstance(buf, bytes) or buf.readonly:
        buf = bytearray(buf)  # see module docstring: copy instead of aliasing immutable memory
    tensor = torch.frombuffer(buf, dtype=torch.uint8)
    if tensor.data_ptr() % dtype.itemsize:
        tensor = tensor.clone()  # unaligned (small frames can sit at odd offsets of zmq's buffer)
    return tensor.view(dtype).reshape(shape)


def _gather(views: list[memoryview], first: int, count: int, nbytes: int, alloc: Alloc) -> torch.Tensor:
    """One buffer holding frames first..first+count-1 back to back (one copy per byte)."""
    out = alloc(nbytes)
    at = 0
    if out.device.type == "cpu":
        dst = out.numpy()  # numpy copies from read-only buffers too (torch.frombuffer would warn)
        for view in views[first : first + count]:
            dst[at : at + view.nbytes] = np.frombuffer(view, dtype=np.uint8)
            at += view.nbytes
        return out
    for view in views[first : first + count]:  # straight into the device tensor, frame by frame
        if view.nbytes:
            out[at : at + view.nbytes].copy_(torch.frombuffer(view, dtype=torch.uint8))
        at += view.nbytes
    return out


def _host_alloc(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def decode(
    frames: Sequence[Any],
    *,
    max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
    max_header_bytes: int = MAX_HEADER_BYTES,
    ring: SharedRing | None = None,
    alloc: Alloc = _host_alloc,
) -> Message:
    """Parse and validate a frame set; raises `ProtocolError` (or `ProtocolVersionError`) if malformed.

    Tensors are views of the frame buffers where possible: keep `frames` immutable while you use them.
    `ring`: the shared-memory ring this peer mapped; a header naming a slot without one, or naming a slot
    or byte range outside it, is malformed. `alloc`: where multi-frame tensors are reassembled.
    """
    if not isinstance(frames, (list, tuple)) or not frames:
        raise ProtocolError("a message needs at least one frame (the header)")
    if len(frames) > 1 + MAX_FRAMES:
        raise ProtocolError(
            f"{len(frames)} frames: a message has a header and at most {MAX_FRAMES} raw frames"
        )
    views = [_as_bytes_view(f, i) for i, f in enumerate(frames)]
    header = _unpack_header(views[0], max_header_bytes)
    version = _plain(header.get("v"), "'v'")
    if type(version) is not int:
        raise ProtocolError(f"header 'v' (protocol version) must be an int, got {version!r:.40}")
    if version != PROTOCOL_VERSION:
        raise ProtocolVersionError(theirs=version, ours=PROTOCOL_VERSION)
    if header.keys() != _HEADER_KEYS:
        raise ProtocolError(f"header keys must be {sorted(_HEADER_KEYS)}, got {sorted(header, key=repr)}")
    kind_byte = _plain(header["k"], "'k'")
    try:
        if type(kind_byte) is not int:
            raise ValueError
        cls = MESSAGE_TYPES[Kind(kind_byte)]
    except (ValueError, KeyError):
        raise ProtocolError(f"unknown message kind {kind_byte!r:.40}") from None
    kind = cls.KIND.name
    msg = decode_fields(cls.KIND, header["f"])  # every field's type and bounds (tensors still UNSET)
    table = _plain(header["t"], "'t'")
    if not isinstance(table, list):
        raise ProtocolError(f"{kind}: header 't' (tensor table) must be a list")
    if table and not has_tensors(cls):
        raise ProtocolError(f"{kind} carries no tensors, but the header lists {len(table)}")
    if len(table) > MAX_TENSORS:
        raise ProtocolError(f"{kind}: {len(table)} tensors in the table, over the cap of {MAX_TENSORS}")

    # Validate the whole table against the frames (and the ring) before building any tensor.
    entries = [_check_entry(e, i) for i, e in enumerate(table)]
    total, used = 0, 0
    owner: dict[int, str] = {}
    for name, dtype, shape, loc, nbytes in entries:
        total += nbytes
        if total > max_tensor_bytes:
            raise ProtocolError(
                f"{kind}: tensors declare {total} bytes (at {name!r}, shape {shape}), over the "
                f"{max_tensor_bytes}-byte cap; raise max_tensor_bytes on both sides if this is intended"
            )
        if isinstance(loc, bytes):
            if len(loc) != nbytes:
                raise ProtocolError(
                    f"tensor {name!r}: inline data has {len(loc)} bytes, shape needs {nbytes}"
                )
            continue
        if isinstance(loc, dict):
            _check_ring_loc(name, loc, nbytes, dtype.itemsize, ring)
            continue
        first, count = (loc, 1) if isinstance(loc, int) else loc
        if not (first >= 1 and first + count <= len(views)):
            last = first + count - 1
            shown = f"frame index {first}" if count == 1 else f"frames {first}..{last}"
            raise ProtocolError(f"tensor {name!r}: {shown} out of range 1..{len(views) - 1}")
        for index in range(first, first + count):
            if index in owner:
                raise ProtocolError(f"tensor {name!r}: frame {index} is used by two tensors")
            owner[index] = name
        used += count
        got = sum(v.nbytes for v in views[first : first + count])
        if got != nbytes:
            where = f"frame {first}" if count == 1 else f"frames {first}..{first + count - 1}"
            raise ProtocolError(f"tensor {name!r}: {where} has {got} bytes, shape {shape} needs {nbytes}")
    if used != len(views) - 1:
        raise ProtocolError(f"{kind}: header references {used} tensor frame(s), got {len(views) - 1}")
    if len({e[0] for e in entries}) != len(entries):
        raise ProtocolError(f"{kind}: duplicate tensor names in the tensor table")

    tensors = {}
    for name, dtype, shape, loc, nbytes in entries:
        if isinstance(loc, bytes):
            tensor = _to_tensor(loc, dtype, shape)
        elif isinstance(loc, dict):
            tensor = ring.view(loc["s"], loc["o"], nbytes).view(dtype).reshape(shape)  # type: ignore[union-attr]
        elif isinstance(loc, list):
            tensor = _gather(views, loc[0], loc[1], nbytes, alloc).view(dtype).reshape(shape)
        else:
            tensor = _to_tensor(views[loc], dtype, shape)
        if dtype == torch.bool and tensor.numel() and tensor.view(torch.uint8).max() > 1:
            raise ProtocolError(f"tensor {name!r}: bool data holds bytes other than 0/1")
        tensors[name] = tensor
    if has_tensors(cls):
        msg.tensors = tensors
        msg.check_tensors()
    return msg


def _check_ring_loc(name: str, loc: dict, nbytes: int, itemsize: int, ring: SharedRing | None) -> None:
    if ring is None:
        raise ProtocolError(f"tensor {name!r} names ring slot {loc['s']}, but this peer mapped no ring")
    if loc["s"] >= ring.slots:
        raise ProtocolError(f"tensor {name!r}: ring slot {loc['s']} out of range 0..{ring.slots - 1}")
    if loc["o"] + nbytes > ring.slot_bytes:
        raise ProtocolError(
            f"tensor {name!r}: {nbytes} bytes at offset {loc['o']} overrun a {ring.slot_bytes}-byte ring slot"
        )
    if loc["o"] % itemsize:
        raise ProtocolError(f"tensor {name!r}: ring offset {loc['o']} is not aligned to {itemsize} bytes")
