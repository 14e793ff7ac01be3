"""Decoding rejects malformed frame sets with a clear `ProtocolError`, before allocating anything."""

from __future__ import annotations

import msgpack
import pytest
import torch

import dflash_pipe.wire.codec as codec
from dflash_pipe.wire import Heartbeat, ProtocolError, ProtocolVersionError, Redirect, Serving, decode, encode
from dflash_pipe.wire.messages import PROTOCOL_VERSION

_REDIRECT = Redirect(producer="node1", address="tcp://127.0.0.1:4000", timeout_s=30.0)


@pytest.fixture
def batch_frames(batch_factory) -> list:
    """A valid BATCH: input_ids raw (frame 1), loss_mask inline, features raw (frame 2)."""
    frames = [bytearray(f) for f in encode(batch_factory([300, 300], hidden=64))]
    assert len(frames) == 3
    return frames


def unpack(frame) -> dict:
    return msgpack.unpackb(bytes(frame), raw=False)


def repack(frames: list, edit) -> list:
    header = unpack(frames[0])
    edit(header)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def rejects(frames, match: str, error: type[Exception] = ProtocolError, **kw) -> None:
    with pytest.raises(error, match=match):
        decode(frames, **kw)


def test_valid_fixture_decodes(batch_frames):
    assert decode(batch_frames).tensors["features"].shape == (600, 64)


def test_bad_header_bytes(batch_frames):
    rejects([], "at least one frame")
    rejects([b"", *batch_frames[1:]], "empty header")
    rejects([bytes(batch_frames[0][: len(batch_frames[0]) // 2]), *batch_frames[1:]], "not valid msgpack")
    rejects([b"\xc1", *batch_frames[1:]], "not valid msgpack")  # 0xc1 is never used by msgpack
    rejects([bytes(batch_frames[0]) + b"\x00", *batch_frames[1:]], "not valid msgpack")  # trailing data
    rejects([msgpack.packb([1, 5, {}, []])], "must be a msgpack map")
    rejects([msgpack.packb({"v": msgpack.ExtType(1, b"x")})], "max_ext_len")  # no extension types
    rejects(["not a buffer"], "not a buffer")


def test_wrong_version_names_both():
    frames = repack(encode(Heartbeat(time=1.0)), lambda h: h.update(v=1))
    with pytest.raises(ProtocolVersionError, match=f"v1.*v{PROTOCOL_VERSION}") as info:
        decode(frames)
    assert (info.value.theirs, info.value.ours) == (1, PROTOCOL_VERSION)
    rejects(repack(frames, lambda h: h.update(v="1")), "must be an int")
    rejects(repack(frames, lambda h: h.pop("v")), "must be an int")


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h: h.update(k=0x7F), "unknown message kind 127"),
        (lambda h: h.update(k=0), "unknown message kind 0"),
        (lambda h: h.update(k="HEARTBEAT"), "unknown message kind"),
        (lambda h: h.update(x=1), "header keys"),
        (lambda h: h.pop("t"), "header keys"),
        (lambda h: h.update(f=[]), "'f' must be a map"),
        (lambda h: h["f"].pop("time"), r"missing field\(s\) \['time'\]"),
        (lambda h: h["f"].update(extra=1), r"unknown field\(s\) \['extra'\]"),
        (lambda h: h["f"].update(time="noon"), "Heartbeat.time': expected float"),
        (lambda h: h.update(t=[["x", "float32", [1], b"\0\0\0\0"]]), "HEARTBEAT carries no tensors"),
    ],
)
def test_bad_header_content(edit, match):
    rejects(repack(encode(Heartbeat(time=1.0)), edit), match)


def _entry(name: str):
    def edit(header, fn):
        entry = next(e for e in header["t"] if e[0] == name)
        fn(entry)

    return edit


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h: h["f"].update(batch_id=-1), "Batch.batch_id': must be >= 0"),
        (lambda h: h["f"].update(sample_ids=[1, "2"]), r"Batch.sample_ids\[1\]': expected int"),
        (lambda h: h["f"].update(lengths=[300, 299]), r"sum\(lengths\) = 599"),
        (lambda h: h.update(t={}), "tensor table"),
        (lambda h: h["t"].append(["x", "float32"]), "must be \\[name, dtype, shape, loc\\]"),
        (lambda h: h["t"][0].__setitem__(0, ""), "non-empty str"),
        (lambda h: h["t"][2].__setitem__(1, "float64"), "dtype 'float64' is not allowed"),
        (lambda h: h["t"][2].__setitem__(1, "object"), "dtype 'object' is not allowed"),
        (lambda h: h["t"][2].__setitem__(2, [600, -64]), "non-negative ints"),
        (lambda h: h["t"][2].__setitem__(2, [600, 64.0]), "non-negative ints"),
        (lambda h: h["t"][2].__setitem__(2, [1] * 9), "at most 8"),
        (lambda h: h["t"][2].__setitem__(3, 5), "frame index 5 out of range"),
        (lambda h: h["t"][2].__setitem__(3, 0), "frame index 0 out of range"),
        (lambda h: h["t"][2].__setitem__(3, 1), "used by two tensors"),
        (lambda h: h["t"][2].__setitem__(3, "2"), "loc must be"),
        (lambda h: h["t"][2].__setitem__(2, [600, 32]), "frame 2 has 76800 bytes"),
        (lambda h: h["t"][1].__setitem__(3, b"\x01" * 599), "inline data has 599 bytes"),
        (lambda h: h["t"][1].__setitem__(3, b"\x02" * 600), "bool data holds bytes other than 0/1"),
        (lambda h: h["t"].append(h["t"][1]), "duplicate tensor names"),
        (lambda h: h["t"][2].__setitem__(3, [2, 1]), r"frame range must be \[first, count >= 2\]"),
        (lambda h: h["t"][2].__setitem__(3, [2, 2, 2]), "frame range must be"),
        (lambda h: h["t"][2].__setitem__(3, [2, 5]), r"frames 2..6 out of range"),
        (lambda h: h["t"][2].__setitem__(3, [1, 2]), "used by two tensors"),
        (lambda h: h["t"][2].__setitem__(3, [2, True]), "frame range must be"),
        (lambda h: h["t"][2].__setitem__(3, {"s": 0, "o": 0}), "this peer mapped no ring"),
        (lambda h: h["t"][2].__setitem__(3, {"s": 0}), "ring location must be"),
        (lambda h: h["t"][2].__setitem__(3, {"s": -1, "o": 0}), "ring location must be"),
        (lambda h: h["t"][2].__setitem__(3, {"s": 0, "o": 0, "x": 1}), "ring location must be"),
    ],
)
def test_bad_tensor_table(batch_frames, edit, match):
    rejects(repack(batch_frames, edit), match)


def test_frame_size_and_count_mismatch(batch_frames):
    rejects([*batch_frames[:2], batch_frames[2][:-2]], "frame 2 has 76798 bytes")
    rejects([*batch_frames, b"extra"], r"references 2 tensor frame\(s\), got 3")
    rejects(batch_frames[:2], "frame index 2 out of range")


def test_declared_size_over_cap_rejected_before_allocation(batch_frames, monkeypatch):
    def no_alloc(*args, **kwargs):
        raise AssertionError("decode allocated before validating sizes")

    monkeypatch.setattr(codec.torch, "empty", no_alloc)
    monkeypatch.setattr(codec.torch, "frombuffer", no_alloc)
    huge = repack(batch_frames, lambda h: h["t"][2].__setitem__(2, [2**40, 2**20]))  # 2 PiB of bf16
    rejects(huge, "over the 8589934592-byte cap")
    inline_huge = repack(batch_frames, lambda h: h["t"][1].__setitem__(2, [2**62, 2**62]))
    rejects(inline_huge, "cap")
    # The cap is configurable; the real message is 600*8 + 600 + 600*64*2 = 82200 bytes.
    rejects(batch_frames, "over the 80000-byte cap", max_tensor_bytes=80_000)


def test_decode_accepts_the_configured_cap_exactly(batch_frames):
    assert decode(batch_frames, max_tensor_bytes=82_200).tensors["input_ids"].dtype == torch.int64


def test_frame_count_and_tensor_table_are_capped(batch_frames):
    rejects([*batch_frames, *([b"x"] * codec.MAX_FRAMES)], f"at most {codec.MAX_FRAMES} raw frames")
    table = [[f"t{i}", "uint8", [1], b"\x00"] for i in range(codec.MAX_TENSORS + 1)]
    rejects(repack(batch_frames[:1], lambda h: h.update(t=table)), "over the cap of 64")


def test_header_cap_is_configurable(batch_frames):
    rejects(batch_frames, "header frame of .* exceeds the 16-byte cap", max_header_bytes=16)


@pytest.mark.parametrize(
    "msg, edit, match",
    [
        (
            Serving(address="tcp://10.0.0.7:4000"),
            lambda f: f.update(address=7),
            "Serving.address': expected str",
        ),
        (
            Serving(address="tcp://10.0.0.7:4000"),
            lambda f: f.pop("address"),
            r"missing field\(s\) \['address'\]",
        ),
        (Serving(address="tcp://10.0.0.7:4000"), lambda f: f.update(address="inproc://x"), "matching regex"),
        (
            Serving(address="tcp://10.0.0.7:4000"),
            lambda f: f.update(address="tcp://a\nb:1"),
            "matching regex",
        ),
        (
            Serving(address="tcp://10.0.0.7:4000"),
            lambda f: f.update(address="tcp://" + "9" * 5000),
            "<= 1024",
        ),
        (Serving(address="tcp://10.0.0.7:4000"), lambda f: f.update(serves="x"), r"unknown field\(s\)"),
        (_REDIRECT, lambda f: f.update(address="file:///etc/passwd"), "Redirect.address'.*matching regex"),
        (_REDIRECT, lambda f: f.update(producer="p" * 300), "Redirect.producer'.*<= 256"),
        (_REDIRECT, lambda f: f.update(producer=["node1"]), "Redirect.producer': expected str"),
        (_REDIRECT, lambda f: f.update(timeout_s=-1.0), "Redirect.timeout_s': must be > 0"),
        (_REDIRECT, lambda f: f.update(timeout_s="soon"), "Redirect.timeout_s': expected float"),
        (_REDIRECT, lambda f: f.pop("timeout_s"), r"missing field\(s\) \['timeout_s'\]"),
    ],
)
def test_hostile_serving_and_redirect_are_refused(msg, edit, match):
    """The address an attached producer announces and the redirect a worker follows are bounded and
    checked before anyone connects anywhere: tcp:// or ipc:// only, no whitespace, at most 1024 bytes."""
    rejects(repack(encode(msg), lambda h: edit(h["f"])), match)
