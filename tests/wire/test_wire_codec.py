"""Codec round trips, golden frame layout and zero-copy guarantees."""

from __future__ import annotations

import msgpack
import msgspec
import pytest
import torch

from dflash_pipe.wire import DTYPES, INLINE_MAX_BYTES, Batch, Kind, decode, encode

ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16]
ALL_DTYPES += [torch.int8, torch.uint8, torch.bool]
if hasattr(torch, "float8_e4m3fn"):
    ALL_DTYPES.append(torch.float8_e4m3fn)


def raw_bytes(t: torch.Tensor) -> bytes:
    """Independent reference for bit-exactness: the tensor's bytes via a contiguous byte copy."""
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    for f in msgspec.structs.fields(a):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if f.name == "tensors":
            assert list(va) == list(vb)
            for name in va:
                assert va[name].dtype == vb[name].dtype, name
                assert va[name].shape == vb[name].shape, name
                assert raw_bytes(va[name]) == raw_bytes(vb[name]), name
        else:
            assert va == vb and type(va) is type(vb), f.name


def header_of(frames) -> dict:
    return msgpack.unpackb(frames[0], raw=False)


def test_round_trip_every_kind(messages):
    for msg in messages:
        frames = encode(msg)
        assert all(isinstance(f, (bytes, memoryview)) for f in frames)
        assert_same(decode(frames), msg)
        assert_same(decode([bytes(f) for f in frames]), msg)  # read-only buffers work too


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (700, 3)], ids=str)
def test_tensor_round_trip_bit_exact(dtype, shape):
    g = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        t = torch.rand(shape, generator=g) > 0.5
    elif dtype.is_floating_point:
        t = (torch.randn(shape, generator=g) * 3).to(dtype)
    else:
        t = torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)
    msg = Batch(batch_id=0, epoch=0, sample_ids=[], lengths=[], tensors={"t": t})
    frames = encode(msg)
    nbytes = t.numel() * t.element_size()
    assert len(frames) == (1 if nbytes <= INLINE_MAX_BYTES else 2)
    out = decode(frames).tensors["t"]
    assert out.dtype == dtype and out.shape == t.shape
    assert raw_bytes(out) == raw_bytes(t)
    if dtype != torch.float8_e4m3fn:
        assert torch.equal(out, t)


def test_bf16_special_values_bit_exact():
    # NaN payloads, -0.0, infs, subnormals: compared as raw int16 bits.
    bits = torch.tensor([0x7FC1, 0xFFC0, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x3F80] * 100, dtype=torch.int32)
    t = bits.to(torch.int16).view(torch.bfloat16)
    out = decode(encode(Batch(batch_id=0, epoch=0, sample_ids=[], lengths=[], tensors={"f": t}))).tensors["f"]
    assert torch.equal(out.view(torch.int16), t.view(torch.int16))


def test_int64_extremes_and_non_contiguous():
    big = torch.tensor([-(2**63), 2**63 - 1, 0, -1] * 64, dtype=torch.int64)
    base = torch.randn(64, 48).to(torch.bfloat16)
    tensors = {
        "big": big,
        "transposed": base.t(),  # [48, 64], non-contiguous
        "strided": base[::2, 5:40],  # [32, 35]
        "expanded": torch.arange(4.0).expand(300, 4),  # stride 0
    }
    assert not tensors["transposed"].is_contiguous()
    out = decode(encode(Batch(batch_id=0, epoch=0, sample_ids=[], lengths=[], tensors=tensors))).tensors
    for name, t in tensors.items():
        assert out[name].shape == t.shape and out[name].is_contiguous()
        assert torch.equal(out[name], t), name


def test_golden_frame_layout(batch_factory):
    # Pins the frame layout: change it deliberately (and bump PROTOCOL_VERSION).
    msg = batch_factory([300, 300], hidden=64)  # input_ids 4800 B raw, loss_mask 600 B inline, features raw
    frames = encode(msg)
    assert len(frames) == 3
    header = header_of(frames)
    assert list(header) == ["v", "k", "f", "t"]
    assert header["v"] == 7 and header["k"] == Kind.BATCH == 5
    assert header["f"] == {
        "batch_id": 7,
        "epoch": 2,
        "sample_ids": [100, 101],
        "lengths": [300, 300],
        "for_eval": False,
        "eval_set": 0,
    }
    (n0, d0, s0, l0), (n1, d1, s1, l1), (n2, d2, s2, l2) = header["t"]
    assert (n0, d0, s0, l0) == ("input_ids", "int64", [600], 1)
    assert (n1, d1, s1) == ("loss_mask", "bool", [600]) and isinstance(l1, bytes) and len(l1) == 600
    assert (n2, d2, s2, l2) == ("features", "bfloat16", [600, 64], 2)
    assert len(frames[1]) == 600 * 8 and memoryview(frames[2]).nbytes == 600 * 64 * 2

    small = encode(batch_factory([4, 4], hidden=8))  # everything under 1 KiB: header only
    assert len(small) == 1 and all(isinstance(e[3], bytes) for e in header_of(small)["t"])
    assert header_of(encode(msgspec.structs.replace(msg, tensors={})))["t"] == []


def test_golden_frame_layout_with_frame_bytes(batch_factory):
    # features of 600 x 256 bf16 = 307200 B in 128 KiB frames: 131072 + 131072 + 45056, as views, in order.
    msg = batch_factory([300, 300], hidden=256)
    frames = encode(msg, frame_bytes=128 << 10)
    header = header_of(frames)
    assert [e[3] for e in header["t"]][0::2] == [1, [2, 3]]  # input_ids one frame, features frames 2..4
    assert [memoryview(f).nbytes for f in frames[1:]] == [4800, 131072, 131072, 45056]
    base = msg.tensors["features"].data_ptr()
    assert [_addr(f) - base for f in frames[2:]] == [0, 131072, 262144]  # zero-copy slices
    out = decode(frames)
    assert torch.equal(out.tensors["features"], msg.tensors["features"])
    assert len(encode(msg, frame_bytes=1 << 20)) == 3  # under the frame size: one frame as before
    with pytest.raises(ValueError, match="below the minimum"):
        encode(msg, frame_bytes=1000)


def test_multi_frame_tensor_is_gathered_into_the_given_buffer(batch_factory):
    msg = batch_factory([1000, 1000], hidden=512)  # 2 MB of bf16 features
    frames = [bytearray(f) for f in encode(msg, frame_bytes=64 << 10)]
    buffers = []

    def alloc(n: int) -> torch.Tensor:
        buffers.append(torch.empty(n, dtype=torch.uint8))
        return buffers[-1]

    out = decode(frames, alloc=alloc)
    assert len(buffers) == 1 and out.tensors["features"].data_ptr() == buffers[0].data_ptr()
    assert torch.equal(out.tensors["features"], msg.tensors["features"])
    assert torch.equal(out.tensors["input_ids"], msg.tensors["input_ids"])


@pytest.mark.parametrize("frame_kib", [64, 100, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_frame_sizes_round_trip_bit_exact(frame_kib, dtype):
    t = (torch.randn(3001, 37) * 1000).to(dtype)
    msg = Batch(batch_id=0, epoch=0, sample_ids=[], lengths=[], tensors={"a": t, "b": t[::2].t()})
    out = decode([bytes(f) for f in encode(msg, frame_bytes=frame_kib << 10)]).tensors
    assert raw_bytes(out["a"]) == raw_bytes(t) and raw_bytes(out["b"]) == raw_bytes(t[::2].t())


def test_dtype_allow_list():
    assert set(DTYPES) >= {
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    }
    with pytest.raises(ValueError, match="float64"):
        encode(Batch(batch_id=0, epoch=0, sample_ids=[], lengths=[], tensors={"x": torch.zeros(2).double()}))


def _addr(buf) -> int:
    return torch.frombuffer(buf, dtype=torch.uint8).data_ptr()  # writable buffers only: no copy


def test_encode_is_zero_copy_for_contiguous_tensors(batch_factory):
    msg = batch_factory([512, 512], hidden=256)
    frames = encode(msg)
    where = {e[0]: e[3] for e in header_of(frames)["t"]}
    assert where == {"input_ids": 1, "loss_mask": 2, "features": 3}  # 1024-byte mask: not inline
    for name, idx in where.items():
        assert _addr(frames[idx]) == msg.tensors[name].data_ptr(), name


def test_decode_is_zero_copy_over_writable_frames(batch_factory):
    msg = batch_factory([512, 512], hidden=256)
    frames = [bytearray(f) for f in encode(msg)]  # like zmq frames: writable buffers we own
    out = decode(frames)
    for name, idx in {e[0]: e[3] for e in header_of(frames)["t"]}.items():
        start, size = _addr(frames[idx]), len(frames[idx])
        assert start <= out.tensors[name].data_ptr() < start + size, name
    frames[3][0] ^= 0xFF  # the decoded tensor aliases the frame
    assert out.tensors["features"].view(torch.uint8).reshape(-1)[0] == frames[3][0]


def test_decode_copies_read_only_frames_without_warning(batch_factory, recwarn):
    msg = batch_factory([512, 512], hidden=256)
    frames = [bytes(f) for f in encode(msg)]
    out = decode(frames)
    out.tensors["features"].zero_()  # must not write into the immutable bytes
    assert frames[3] == bytes(encode(msg)[3])
    assert not [w for w in recwarn if "not writable" in str(w.message)]
