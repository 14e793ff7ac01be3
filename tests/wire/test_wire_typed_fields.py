"""What msgspec's typed decoders would take but the wire refuses, and the errors they give in its words."""

from __future__ import annotations

import msgpack
import pytest
import torch

from dflash_pipe.wire import Hello, Plan, ProtocolError, decode, encode


def edited(msg, edit) -> list:
    frames = [bytes(f) for f in encode(msg)]
    header = msgpack.unpackb(frames[0], raw=False)
    edit(header)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def rejects(frames, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(frames)


def test_tensors_never_travel_in_the_field_map(batch_factory):
    batch = batch_factory([3, 5])
    rejects(edited(batch, lambda h: h["f"].update(tensors={})), r"unknown field\(s\) \['tensors'\]")
    rejects(edited(batch, lambda h: h["f"].update(tensors={"x": 1})), "tensor table 't'")


def test_free_form_dicts_hold_plain_values_only(messages):
    welcome = next(m for m in messages if m.KIND.name == "WELCOME")
    ext = msgpack.ExtType(3, b"x")
    rejects(edited(welcome, lambda h: h["f"]["drafter"].update(x=ext)), "extension type 3 is not allowed")
    rejects(
        edited(welcome, lambda h: h["f"]["drafter"].update(x=b"raw")), r"Welcome.drafter.x': expected None"
    )
    rejects(edited(welcome, lambda h: h["f"]["train"].update({"1": {2: 3}})), r"Welcome.train.1 key'")


def test_enum_inline_and_missing_defaulted_fields():
    hello = Hello(worker_name="w", host="h", pid=1, device="cpu")
    rejects(
        edited(hello, lambda h: h["f"].update(role="boss")), r"'boss' is not one of \['worker', 'producer'\]"
    )
    rejects(edited(hello, lambda h: h["f"].update(pid=1.5)), r"Hello.pid': expected int, got float 1.5")
    # a field with a default may be left out by a peer: msgspec fills it in
    assert decode(edited(hello, lambda h: h["f"].pop("host_id"))).host_id == ""
    tensors = {
        "input_ids": torch.zeros(2000, dtype=torch.uint8),
        "loss_mask": torch.ones(2000, dtype=torch.uint8),
    }
    plan = Plan(batch_id=0, epoch=0, sample_ids=[0], lengths=[2000], tensors=tensors)
    rejects(edited(plan, lambda h: h["t"][0].__setitem__(3, b"\0" * 2000)), "2000 inline bytes, over 1023")


def test_the_sender_gets_the_error_its_peer_would():
    with pytest.raises(ProtocolError, match=r"field 'Hello.pid': must be >= 0, got -1"):
        encode(Hello(worker_name="w", host="h", pid=-1, device="cpu"))
    with pytest.raises(ProtocolError, match="not a registered wire message"):
        encode(object())  # type: ignore[arg-type]
