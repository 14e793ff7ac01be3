"""Live ROUTER/DEALER exchanges over ipc:// and tcp://127.0.0.1:0."""

from __future__ import annotations

import tempfile
import time

import pytest
import torch
import zmq

from dflash_pipe.wire import (
    Ack,
    BadMessage,
    Error,
    Heartbeat,
    Hello,
    PeerGoneError,
    ProducerEndpoint,
    ProtocolError,
    Ready,
    Reject,
    SendTimeoutError,
    Welcome,
    WorkerEndpoint,
    decode,
    encode,
)
from dflash_pipe.wire.auth import generate_keys

T = 5.0  # generous receive timeout; every exchange below completes in milliseconds


@pytest.fixture(params=["ipc", "tcp"])
def address(request):
    if request.param == "tcp":
        yield "tcp://127.0.0.1:0"
    else:
        with tempfile.TemporaryDirectory(prefix="dfw") as d:  # short path: ipc paths are limited to ~107 B
            yield f"ipc://{d}/p.sock"


@pytest.fixture
def pair(address):
    producer = ProducerEndpoint(address)
    worker = WorkerEndpoint(producer.address)
    yield producer, worker
    worker.close(linger_s=0)
    producer.close(linger_s=0)


def test_handshake_and_batch(pair, messages, batch_factory):
    producer, worker = pair
    if producer.address.startswith("tcp://"):
        assert producer.address.startswith("tcp://127.0.0.1:") and not producer.address.endswith(":0")

    hello = next(m for m in messages if isinstance(m, Hello))
    worker.send(hello)
    peer, got = producer.recv(T)
    assert got == hello and isinstance(peer, bytes) and peer

    welcome = next(m for m in messages if isinstance(m, Welcome))
    producer.send(peer, welcome)
    assert worker.recv(T) == welcome

    worker.send(Ready(credits=2))
    assert producer.recv(T) == (peer, Ready(credits=2))

    batch = batch_factory([4096, 4096, 2048], hidden=256)  # features: 10240 x 256 bf16 = 5 MiB
    tracker = producer.send(peer, batch, track=True)
    got = worker.recv(T)
    tracker.wait(T)
    assert tracker.done
    assert (got.batch_id, got.epoch, got.sample_ids, got.lengths) == (
        7,
        2,
        [100, 101, 102],
        [4096, 4096, 2048],
    )
    for name, t in batch.tensors.items():
        assert got.tensors[name].dtype == t.dtype and torch.equal(got.tensors[name], t), name

    worker.send(Ack(batch_ids=[got.batch_id], step=1))
    assert producer.recv(T) == (peer, Ack(batch_ids=[7], step=1))


def test_received_tensors_view_the_zmq_frame(batch_factory):
    # What the endpoints do on receive, checked at the frame level: decode over zmq frames copies nothing.
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://zc")
        b.connect("inproc://zc")
        a.send_multipart(encode(batch_factory([2048, 2048], hidden=256)), copy=False)
        frames = b.recv_multipart(copy=False)
        out = decode(frames)
        start = torch.frombuffer(frames[-1], dtype=torch.uint8).data_ptr()
        assert start <= out.tensors["features"].data_ptr() < start + len(frames[-1].buffer)
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def test_recv_timeout_returns_none(pair):
    producer, worker = pair
    for endpoint in (producer, worker):
        t0 = time.monotonic()
        assert endpoint.recv(0.1) is None
        assert time.monotonic() - t0 >= 0.09  # it waited its timeout (a lower bound: load only adds to it)


def test_send_to_unknown_peer_raises_at_once(address):
    """No such peer is an immediate PeerGoneError: a send that waited for the peer would end, after
    send_timeout_s, in a SendTimeoutError instead."""
    producer = ProducerEndpoint(address, send_timeout_s=600.0)
    try:
        with pytest.raises(PeerGoneError, match="gone") as info:
            producer.send(b"\x00nobody", Heartbeat(time=0.0))
        assert info.value.peer == b"\x00nobody"
    finally:
        producer.close(linger_s=0)


def test_send_to_disconnected_peer_raises(pair):
    producer, worker = pair
    worker.send(Heartbeat(time=1.0))
    peer, _ = producer.recv(T)
    worker.close(linger_s=0)
    deadline = time.monotonic() + T
    with pytest.raises(PeerGoneError):  # once libzmq has seen the disconnect
        while time.monotonic() < deadline:
            producer.send(peer, Heartbeat(time=2.0))
            time.sleep(0.01)


def test_bad_message_names_the_peer_and_endpoint_survives(address):
    producer = ProducerEndpoint(address)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    try:
        raw.connect(producer.address)
        raw.send_multipart([b"\xc1garbage"])
        with pytest.raises(BadMessage) as info:
            producer.recv(T)
        assert isinstance(info.value.error, ProtocolError) and "msgpack" in str(info.value)
        producer.send(info.value.peer, Reject(reason="bad frame"))  # the producer can answer that peer
        assert decode(raw.recv_multipart()) == Reject(reason="bad frame")
        raw.send_multipart(encode(Heartbeat(time=3.0)))  # ... and carry on
        assert producer.recv(T) == (info.value.peer, Heartbeat(time=3.0))
    finally:
        raw.close(0)
        ctx.term()
        producer.close(linger_s=0)


def test_send_final_delivers_and_closes(pair):
    producer, worker = pair
    assert worker.send_final(Error(source="worker 0", message="boom", traceback="tb"), linger_s=2.0)
    _, got = producer.recv(T)
    assert got == Error(source="worker 0", message="boom", traceback="tb")
    assert worker.send_final(Heartbeat(time=0.0)) is False  # already closed: no raise
    worker.close()  # idempotent
    producer.close()
    producer.close()


def test_slow_reader_raises_send_timeout(batch_factory):
    with tempfile.TemporaryDirectory(prefix="dfw") as d:
        producer = ProducerEndpoint(f"ipc://{d}/p.sock", hwm=1, send_timeout_s=0.1)
        worker = WorkerEndpoint(producer.address, hwm=1)
        try:
            worker.send(Heartbeat(time=0.0))
            peer, _ = producer.recv(T)
            batch = batch_factory([4096, 4096], hidden=512)  # 8 MiB per message, shared storage
            with pytest.raises(SendTimeoutError):
                for _ in range(200):  # the worker never reads: socket buffers and HWM fill up
                    producer.send(peer, batch)
        finally:
            worker.close(linger_s=0)
            producer.close(linger_s=0)


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:0", "tcp://*:0", "tcp://10.1.2.3:5555", "tcp://eth0:0"])
def test_public_bind_without_keys_refused_naming_the_fix(address):
    with pytest.raises(ValueError, match=r"dflash-pipe keys generate DIR.*--keys DIR"):
        ProducerEndpoint(address)


def test_public_bind_allowed_with_keys(tmp_path):
    generate_keys(tmp_path / "keys")
    with ProducerEndpoint("tcp://0.0.0.0:0", keys=tmp_path / "keys") as producer:
        assert producer.address.startswith("tcp://0.0.0.0:")


@pytest.mark.parametrize("address", ["127.0.0.1:5555", "udp://127.0.0.1:1", "tcp://127.0.0.1"])
def test_malformed_address(address):
    with pytest.raises(ValueError, match="address"):
        ProducerEndpoint(address)


def test_closed_endpoint_raises():
    producer = ProducerEndpoint()
    producer.close()
    with pytest.raises(ConnectionError, match="closed"):
        producer.recv(0.0)


def test_reject_never_blocks_on_a_peer_that_does_not_read(address, caplog):
    producer = ProducerEndpoint(address, hwm=1, send_timeout_s=60.0)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    try:
        raw.connect(producer.address)
        raw.send_multipart([b"\xc1"])
        with pytest.raises(BadMessage) as info:
            producer.recv(T)
        t0 = time.monotonic()
        queued = [producer.reject(info.value.peer, "x" * 100_000) for _ in range(500)]
        # A blocking reject would wait send_timeout_s once the queue is full: 500 of them not one timeout.
        assert time.monotonic() - t0 < producer.send_timeout_s
        assert queued[0] and not all(queued)  # the queue filled up and the rest were dropped
        assert 1 <= caplog.text.count("REJECT to peer") <= 10  # logged, rate limited
    finally:
        raw.close(0)
        ctx.term()
        producer.close(linger_s=0)


def test_producer_refuses_frames_over_the_inbound_cap(address):
    producer = ProducerEndpoint(address, max_frame_bytes=1 << 16)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    try:
        raw.connect(producer.address)
        raw.send_multipart([b"\x00" * (1 << 17)])  # libzmq drops the connection; Python never sees it
        assert producer.recv(0.5) is None
        small = WorkerEndpoint(producer.address)
        small.send(Heartbeat(time=4.0))
        assert producer.recv(T)[1] == Heartbeat(time=4.0)
        small.close(linger_s=0)
    finally:
        raw.close(0)
        ctx.term()
        producer.close(linger_s=0)
