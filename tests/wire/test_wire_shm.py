"""Shared-memory ring: slots are never overwritten while leased, references round-trip bit-exactly across
processes, a killed worker's slots come back, and nothing is left behind after SIGKILL."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from dflash_pipe.producer.scheduler import BatchScheduler, ReadyBatch
from dflash_pipe.wire import Batch, ProtocolError, decode, encode
from dflash_pipe.wire.shm import RingOffer, RingUnavailable, ShmRing, host_identity, shm_supported
from dflash_pipe.wire.transport import ProducerEndpoint, WorkerEndpoint
from tests.wire.ring_checks import check_back_pressure

pytestmark = pytest.mark.skipif(not shm_supported(), reason="memfd and /proc are Linux-only")


@pytest.fixture
def ring():
    r = ShmRing.create(slots=3, slot_bytes=64 << 10, pin=False)
    yield r
    r.close()


def staged_batch(ring: ShmRing, tokens: int = 100, width: int = 64, seed: int = 0):
    """A BATCH whose features (and fp8-style scales) are views of one ring slot."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(tokens, width, generator=g).to(torch.bfloat16)
    scales = torch.rand(tokens, 2, generator=g)
    at = -(-feats.numel() * 2 // 64) * 64  # scales after the features, 64-byte aligned
    slot = ring.acquire(at + scales.numel() * 4)
    f = slot.view((tokens, width), torch.bfloat16)
    s = slot.view((tokens, 2), torch.float32, offset=at)
    f.copy_(feats)
    s.copy_(scales)
    msg = Batch(
        batch_id=1,
        epoch=0,
        sample_ids=[5],
        lengths=[tokens],
        tensors={"input_ids": torch.arange(tokens), "features": f, "feature_scales": s},
    )
    return msg, slot, feats, scales


def test_acquire_blocks_while_every_slot_is_leased(ring):
    check_back_pressure(ring)


def test_oversized_batch_gets_private_memory(ring):
    slot = ring.acquire(ring.slot_bytes + 1)
    assert slot.slot_id is None and slot.buffer.numel() == ring.slot_bytes + 1
    assert ring.leased == 0


def test_encode_names_the_slot_and_decode_views_it(ring):
    msg, slot, feats, scales = staged_batch(ring)
    frames = encode(msg, ring=ring)
    assert len(frames) == 1  # input_ids 800 B inline; features and scales by reference
    out = decode(frames, ring=ring)
    assert torch.equal(out.tensors["features"], feats) and torch.equal(out.tensors["feature_scales"], scales)
    assert out.tensors["features"].data_ptr() == msg.tensors["features"].data_ptr()
    # without the ring (a remote worker) the same message travels as frames
    plain = encode(msg)
    assert len(plain) == 2 and torch.equal(decode(plain).tensors["features"], feats)
    with pytest.raises(ProtocolError, match="mapped no ring"):
        decode(frames)


def test_header_naming_a_slot_out_of_range_is_bad(ring):
    msg, *_ = staged_batch(ring)
    other = ShmRing.create(slots=8, slot_bytes=ring.slot_bytes, pin=False)
    try:
        big, slot7, *_ = staged_batch(other)
        while slot7.slot_id != 7:  # lease slots 0..7 of the bigger ring and send from the last
            big, slot7, *_ = staged_batch(other)
        with pytest.raises(ProtocolError, match="ring slot 7 out of range 0..2"):
            decode(encode(big, ring=other), ring=ring)
    finally:
        other.close()


def test_killed_workers_batches_come_back_with_their_slots(ring):
    sched = BatchScheduler(plan_epoch=lambda e, x: [[0], [1]], epochs=1)
    for _ in range(2):
        plan = sched.next_plan()
        sched.add_ready(ReadyBatch(plan=plan, payload=None, tokens=1, slot=ring.acquire(100)))
    a, b = b"worker-a", b"worker-b"
    leased = [sched.lease_next(a, 0.0), sched.lease_next(a, 0.0)]
    assert ring.leased == 2
    assert sched.release(a) == 2  # worker a was SIGKILLed: its leases go back, slots still held
    assert ring.leased == 2
    again = [sched.lease_next(b, 1.0), sched.lease_next(b, 1.0)]
    assert [x.slot.slot_id for x in again] == [x.slot.slot_id for x in leased]
    sched.ack(a, [0, 1])  # a late ACK from the dead worker frees nothing
    assert ring.leased == 2
    sched.ack(b, [0, 1])
    assert ring.leased == 0 and sched.next_plan() is None and sched.finished()


# --- across processes ------------------------------------------------------------------------------------


def _worker_reads(address: str, offer: dict, result) -> None:
    ring = ShmRing.attach(RingOffer.from_dict(offer), pin=False)
    with WorkerEndpoint(address) as ep:
        ep.ring = ring
        from dflash_pipe.wire import Heartbeat

        ep.send(Heartbeat(time=0.0))
        msg = ep.recv(timeout_s=30)
        t = msg.tensors
        result.put((bytes(t["features"].view(torch.uint8).reshape(-1)), t["feature_scales"].tolist()))
    ring.close()


def test_worker_process_maps_the_ring_and_reads_bit_exact(ring):
    msg, _slot, feats, scales = staged_batch(ring, seed=3)
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    with ProducerEndpoint("tcp://127.0.0.1:0") as ep:
        proc = ctx.Process(target=_worker_reads, args=(ep.address, ring.offer().to_dict(), result))
        proc.start()
        peer, _hello = ep.recv(timeout_s=60)
        ep.send(peer, msg, ring=ring)
        raw, got_scales = result.get(timeout=60)
        proc.join(30)
    assert proc.exitcode == 0
    assert raw == bytes(feats.view(torch.uint8).reshape(-1)) and got_scales == scales.tolist()


def test_attach_refuses_a_wrong_token(ring):
    offer = ring.offer()
    bad = RingOffer(
        pid=offer.pid, fd=offer.fd, slots=offer.slots, slot_bytes=offer.slot_bytes, token="00" * 16
    )
    with pytest.raises(RingUnavailable, match="token mismatch"):
        ShmRing.attach(bad, pin=False)
    with pytest.raises(RingUnavailable, match="cannot open"):
        ShmRing.attach(
            RingOffer(pid=offer.pid, fd=9999, slots=1, slot_bytes=4096, token=offer.token), pin=False
        )
    with pytest.raises(ValueError, match="keys"):
        RingOffer.from_dict({**offer.to_dict(), "extra": 1})
    assert host_identity().count("/") == 2


def _producer_holds_ring(conn) -> None:
    ring = ShmRing.create(slots=2, slot_bytes=1 << 20, pin=False)
    ring.acquire(10).view((10,), torch.uint8).fill_(7)
    conn.send(ring.offer().to_dict())
    time.sleep(600)


def _worker_holds_ring(offer: dict, conn) -> None:
    ring = ShmRing.attach(RingOffer.from_dict(offer), pin=False)
    conn.send(ring.view(0, 0, 10).tolist())
    time.sleep(600)


def _shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if Path("/dev/shm").is_dir() else set()


def test_sigkill_of_producer_and_worker_leaves_nothing_behind():
    before = _shm_names()
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    w_conn, w_child = ctx.Pipe()
    producer = ctx.Process(target=_producer_holds_ring, args=(p_child,))
    producer.start()
    offer = p_conn.recv()
    worker = ctx.Process(target=_worker_holds_ring, args=(offer, w_child))
    worker.start()
    assert w_conn.recv() == [7] * 10  # the worker sees the producer's bytes
    maps = Path(f"/proc/{worker.pid}/maps").read_text()
    assert "memfd:dflash-pipe-ring" in maps  # anonymous: no file-system name to leak
    os.kill(producer.pid, signal.SIGKILL)
    producer.join(10)
    assert w_conn.poll(0) is False and worker.is_alive()  # the worker's mapping stays valid meanwhile
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    # Other processes on this machine may add /dev/shm entries meanwhile (torch, gloo): ours would carry
    # the ring's name, and the maps line above shows it has none in any file system.
    assert not [n for n in _shm_names() - before if "dflash" in n or "ring" in n]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_ring_gpu_to_slot_to_gpu_bit_exact():
    ring = ShmRing.create(slots=2, slot_bytes=8 << 20, pin=True)
    try:
        assert ring.pinned
        src = torch.randn(1024, 1024, device="cuda").to(torch.bfloat16)  # 2 MiB
        slot = ring.acquire(src.numel() * 2)
        slot.view(tuple(src.shape), src.dtype).copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        msg = Batch(
            batch_id=0,
            epoch=0,
            sample_ids=[],
            lengths=[],
            tensors={"features": slot.view(tuple(src.shape), src.dtype)},
        )
        out = decode(encode(msg, ring=ring), ring=ring).tensors["features"]
        assert torch.equal(out.to("cuda", non_blocking=True), src)
    finally:
        ring.close()


def test_frames_gather_straight_into_a_given_tensor():
    src = torch.randn(512, 1024).to(torch.bfloat16)  # 1 MiB in 64 KiB frames
    msg = Batch(batch_id=0, epoch=0, sample_ids=[], lengths=[], tensors={"features": src})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dest = torch.empty(src.numel() * 2, dtype=torch.uint8, device=device)
    out = decode([bytearray(f) for f in encode(msg, frame_bytes=64 << 10)], alloc=lambda n: dest)
    assert out.tensors["features"].data_ptr() == dest.data_ptr()
    assert torch.equal(out.tensors["features"].cpu(), src)
