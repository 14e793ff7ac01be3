"""Message classes: registry, per-field validation (at the sender's encode and the peer's decode), normalization."""

from __future__ import annotations

import msgspec
import pytest
import torch

from dflash_pipe.wire import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Ack,
    Batch,
    Hello,
    Kind,
    Metrics,
    ProtocolError,
    Ready,
    Redirect,
    Serving,
    Welcome,
    decode,
    encode,
)


def test_registry_covers_every_kind_once(messages):
    assert set(MESSAGE_TYPES) == set(Kind)
    assert len(set(MESSAGE_TYPES.values())) == len(Kind)
    assert {type(m).KIND for m in messages} == set(Kind)
    for kind, cls in MESSAGE_TYPES.items():
        assert cls.KIND is kind
    for msg in messages:
        assert not hasattr(msg, "__dict__")  # slots=True
    with pytest.raises(TypeError):
        Ready(1)  # kw_only=True
    for kind, cls in MESSAGE_TYPES.items():  # msgspec does not inherit kw_only: each class says it
        assert cls.__match_args__ == () and cls.__struct_config__.forbid_unknown_fields, kind


def test_kind_bytes_are_pinned():
    # Golden: kind bytes are part of the protocol; changing one needs a PROTOCOL_VERSION bump.
    assert PROTOCOL_VERSION == 7
    assert {k.name: k.value for k in Kind} == {
        "HELLO": 1, "WELCOME": 2, "REJECT": 3, "READY": 4, "BATCH": 5, "ACK": 7,
        "METRICS": 8, "CHECKPOINT": 9, "HEARTBEAT": 10, "ERROR": 11, "DONE": 12, "BYE": 13,
        "PLAN": 14, "SERVING": 15, "REDIRECT": 16,
    }  # fmt: skip


def test_field_names_are_pinned():
    names = {k.name: list(cls.__struct_fields__) for k, cls in MESSAGE_TYPES.items()}
    assert names == {
        "HELLO": ["worker_name", "host", "pid", "device", "capabilities", "host_id",
                  "protocol_version", "role"],
        "WELCOME": [
            "run_id", "rendezvous", "run_dir", "target_path", "drafter", "train", "resume_from",
            "heartbeat_s", "peer_timeout_s", "num_samples", "credits", "eval_batches", "eval_pending", "ring",
            "cuda_ring", "config",
        ],
        "REJECT": ["reason"],
        "READY": ["credits", "shm", "cuda_ipc"],
        "BATCH": ["batch_id", "epoch", "sample_ids", "lengths", "tensors", "for_eval", "eval_set"],
        "ACK": ["batch_ids", "step"],
        "METRICS": ["step", "values"],
        "CHECKPOINT": ["step", "path"],
        "HEARTBEAT": ["time"],
        "ERROR": ["source", "message", "traceback"],
        "DONE": ["reason", "evaluate"],
        "BYE": ["reason"],
        "PLAN": ["batch_id", "epoch", "sample_ids", "lengths", "tensors", "eval_set"],
        "SERVING": ["address"],
        "REDIRECT": ["producer", "address", "timeout_s"],
    }  # fmt: skip


def test_normalization(messages):
    """Decoded, a tuple is a list and an int in a float field a float (in-process, fields stay as given)."""
    welcome = next(m for m in messages if isinstance(m, Welcome))
    assert decode(encode(Ack(batch_ids=(7, 8), step=0))).batch_ids == [7, 8]
    got = decode(encode(msgspec.structs.replace(welcome, heartbeat_s=5)))
    assert type(got.heartbeat_s) is float and got.heartbeat_s == 5.0
    values = decode(encode(Metrics(step=0, values={"a": 1, "b": (2, 3)}))).values
    assert values == {"a": 1.0, "b": [2.0, 3.0]} and type(values["a"]) is float
    assert Hello(worker_name="w", host="h", pid=1, device="cpu").protocol_version == PROTOCOL_VERSION


@pytest.mark.parametrize(
    "build, needle",
    [
        (lambda: Ready(credits=0), "Ready.credits': must be >= 1"),
        (lambda: Ready(credits=True), "Ready.credits': expected int"),
        (lambda: Ready(credits=1.0), "Ready.credits': expected int"),
        (lambda: Ready(credits=2**64), "int64"),
        (lambda: Ack(batch_ids=[1, -1], step=0), "Ack.batch_ids[1]': must be >= 0"),
        (lambda: Ack(batch_ids=5, step=0), "Ack.batch_ids': expected array, got int 5"),
        (lambda: Hello(worker_name=3, host="h", pid=1, device="cpu"), "Hello.worker_name': expected str"),
        (lambda: Hello(worker_name="w" * 257, host="h", pid=1, device="cpu"), "of length <= 256"),
        (lambda: Serving(address="http://node1:80"), "Serving.address': expected `str` matching regex"),
        (lambda: Serving(address="tcp://node1 :1"), "Serving.address': expected `str` matching regex"),
        (
            lambda: Serving(address="tcp://" + "a" * 1100),
            "Serving.address': expected `str` of length <= 1024",
        ),
        (lambda: Redirect(producer="", address="tcp://n:1", timeout_s=1.0), "Redirect.producer': expected"),
        (
            lambda: Redirect(producer="n", address="tcp://n:1", timeout_s=0.0),
            "Redirect.timeout_s': must be > 0",
        ),
        (lambda: Metrics(step=0, values={"a": "x"}), "Metrics.values[...]': expected float | array, got str"),
        (lambda: Metrics(step=0, values={1: 1.0}), "Metrics.values key'"),
        (lambda: Batch(batch_id=0, epoch=0, sample_ids=[1], lengths=[], tensors={}), "1 sample_ids"),
        (
            lambda: Batch(
                batch_id=0, epoch=0, sample_ids=[1], lengths=[3], tensors={"input_ids": torch.zeros(4)}
            ),
            "sum(lengths) = 3",
        ),
        (lambda: Batch(batch_id=0, epoch=0, sample_ids=[], lengths=[], tensors={"x": 1}), "torch.Tensor"),
        (
            lambda: Batch(batch_id=0, epoch=0, sample_ids=[], lengths=[], tensors={}, for_eval=True),
            "Batch.eval_set': 0 with for_eval=True",
        ),
        (
            lambda: Batch(batch_id=0, epoch=0, sample_ids=[], lengths=[], tensors={}, eval_set=2),
            "Batch.eval_set': 2 with for_eval=False",
        ),
    ],
)
def test_bad_fields_raise_protocol_error_naming_the_field(build, needle):
    """Types and bounds are checked when the sender encodes (rules across fields already on construction)."""
    with pytest.raises(ProtocolError) as info:
        encode(build())
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)  # config-style errors stay ValueErrors


def test_welcome_cross_field_and_json_checks(messages):
    base = msgspec.structs.asdict(next(m for m in messages if isinstance(m, Welcome)))
    with pytest.raises(ProtocolError, match=r"Welcome.heartbeat_s': must be > 0"):
        encode(Welcome(**{**base, "heartbeat_s": 0.0}))
    with pytest.raises(ProtocolError, match="NaN"):
        encode(Welcome(**{**base, "heartbeat_s": float("nan")}))
    with pytest.raises(ProtocolError, match=r"Welcome.drafter.bad'"):
        Welcome(**{**base, "drafter": {"bad": object()}})
    deep: dict = {}
    cur = deep
    for _ in range(40):
        cur["x"] = {}
        cur = cur["x"]
    with pytest.raises(ProtocolError, match="nested deeper"):
        Welcome(**{**base, "train": deep})
