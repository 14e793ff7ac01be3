"""CUDA IPC ring: the offer travels as plain msgpack bytes, the handshake picks the path and falls back when
CUDA or the handle is not there; on a GPU, a worker process reads the producer's GPU slots bit-exactly,
full rings apply back-pressure and a killed worker's slots come back.

On a GPU host: ``PYTHONPATH=. python -m pytest tests/wire/test_cuda_ipc.py -q`` (the end-to-end launch is
marked slow, as the other launches)."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import msgspec
import pytest
import torch

from dflash_pipe.bench.transport import _summary
from dflash_pipe.producer.handshake import choose_offers
from dflash_pipe.producer.payloads import payload_for
from dflash_pipe.producer.scheduler import BatchScheduler, ReadyBatch
from dflash_pipe.wire import Ack, Batch, Heartbeat, ProtocolError, Welcome, decode, encode
from dflash_pipe.wire.cuda_ipc import HANDLE_BYTES, CudaIpcOffer, CudaIpcRing, device_uuid
from dflash_pipe.wire.ring import RingUnavailable
from dflash_pipe.wire.shm import ShmRing, shm_supported
from dflash_pipe.wire.transport import ProducerEndpoint, WorkerEndpoint
from dflash_pipe.worker.link import ProducerLink, ready_paths
from tests.wire.ring_checks import check_back_pressure

ROOT = Path(__file__).resolve().parents[2]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
RECV_DEVICE = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"


def an_offer(**changes) -> CudaIpcOffer:
    offer = CudaIpcOffer(
        pid=1,  # never this process: attach must fail on the handle, not on "same process"
        device_uuid=device_uuid(0)
        if torch.cuda.is_available()
        else "GPU-00000000-0000-0000-0000-000000000000",
        handle=bytes(range(HANDLE_BYTES)).hex(),  # no allocation has this handle
        slots=3,
        slot_bytes=1 << 20,
        token="ab" * 16,
    )
    return dataclasses.replace(offer, **changes)


# --- CPU: offers, negotiation, fallback ------------------------------------------------------------------


def test_offer_round_trips_as_plain_msgpack():
    offer = an_offer()
    plain = msgpack.unpackb(msgpack.packb(offer.to_dict(), use_bin_type=True), raw=False)
    assert all(type(v) in (int, str) for v in plain.values())  # a plain map: nothing pickled
    back = CudaIpcOffer.from_dict(plain)
    assert back == offer and bytes.fromhex(back.handle) == bytes(range(HANDLE_BYTES))


def test_offer_rides_in_welcome_through_the_codec(messages):
    welcome = next(m for m in messages if isinstance(m, Welcome))
    sent = msgspec.structs.replace(welcome, cuda_ring=an_offer().to_dict())
    got = decode(encode(sent))
    assert CudaIpcOffer.from_dict(got.cuda_ring) == an_offer() and got.ring == {}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"handle": "00" * 63}, "handle must be a hex string of 64 bytes"),
        ({"handle": "zz" * 64}, "handle must be a hex string"),
        ({"token": 5}, "token must be a hex string of 16 bytes"),
        ({"slots": 0}, "non-negative ints"),
        ({"slot_bytes": -1}, "non-negative ints"),
        ({"pid": True}, "non-negative ints"),
        ({"device_uuid": ""}, "device_uuid"),
        ({"extra": 1}, "must have keys"),
    ],
)
def test_malformed_offers_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        CudaIpcOffer.from_dict({**an_offer().to_dict(), **change})


def test_negotiation_offers_the_gpu_ring_first_and_rejects_what_the_path_forbids():
    cuda_caps, cpu_caps = ["frames", "shm", "cuda_ipc"], ["frames", "shm"]
    both = {"cuda_ring": True, "shm_ring": True}
    assert choose_offers("auto", cuda_caps, same_host=True, **both) == (True, True)
    assert choose_offers("auto", cpu_caps, same_host=True, **both) == (False, True)
    assert choose_offers("auto", cuda_caps, same_host=False, **both) == (False, False)  # remote: frames
    # a CPU target has no GPU ring: CUDA workers get shared memory
    assert choose_offers("auto", cuda_caps, same_host=True, cuda_ring=False, shm_ring=True) == (False, True)
    assert choose_offers("cuda_ipc", cuda_caps, same_host=True, cuda_ring=True, shm_ring=False) == (
        True,
        False,
    )
    assert choose_offers("socket", cuda_caps, same_host=True, cuda_ring=False, shm_ring=False) == (
        False,
        False,
    )
    with pytest.raises(ValueError, match="payload_path is cuda_ipc, but this worker cannot open"):
        choose_offers("cuda_ipc", cpu_caps, same_host=True, **both)
    with pytest.raises(ValueError, match="payload_path is cuda_ipc"):
        choose_offers("cuda_ipc", cuda_caps, same_host=False, **both)
    with pytest.raises(ValueError, match="payload_path is shm"):
        choose_offers("shm", cuda_caps, same_host=False, **both)


@pytest.mark.skipif(not shm_supported(), reason="memfd and /proc are Linux-only")
def test_worker_that_cannot_open_the_handle_falls_back_to_shm_then_frames(messages, capfd):
    """A real failure: without CUDA the runtime is missing; with CUDA the handle names no allocation."""
    welcome = next(m for m in messages if isinstance(m, Welcome))
    shm = ShmRing.create(slots=2, slot_bytes=4096, pin=False)
    with ProducerEndpoint("tcp://127.0.0.1:0") as ep:
        link = ProducerLink(ep.address)
        try:
            offered = msgspec.structs.replace(
                welcome, cuda_ring=an_offer().to_dict(), ring=shm.offer().to_dict()
            )
            ring = link.map_ring(offered, torch.device("cpu"))
            assert isinstance(ring, ShmRing) and ready_paths(ring) == {"shm": True, "cuda_ipc": False}
            err = capfd.readouterr().err
            assert err.count("cannot open the producer's CUDA IPC ring") == 1  # one warning, saying why
            assert "payloads come through shared memory" in err
            ring.close()
            alone = msgspec.structs.replace(welcome, cuda_ring=an_offer().to_dict(), ring={})
            assert link.map_ring(alone, torch.device("cpu")) is None
            assert "payloads come as frames" in capfd.readouterr().err
            assert ready_paths(None) == {"shm": False, "cuda_ipc": False}
        finally:
            link.close()
            shm.close()


def test_without_cuda_no_ring_can_be_made_or_opened():
    if torch.cuda.is_available():
        with pytest.raises(RingUnavailable, match="needs a CUDA device"):
            CudaIpcRing.create(2, 4096, "cpu")
        with pytest.raises(RingUnavailable, match="cannot see"):
            CudaIpcRing.attach(an_offer(device_uuid="GPU-not-here"))
    else:
        for call in (lambda: CudaIpcRing.create(2, 4096, "cuda:0"), lambda: CudaIpcRing.attach(an_offer())):
            with pytest.raises(RingUnavailable, match="CUDA is not available"):
                call()


def test_bench_summary_names_the_faster_same_host_gpu_path():
    def row(path, gbps, frame=None):
        return {"path": path, "size_mib": 126.0, "frame_kib": frame, "iters": 3, "gb_per_s": gbps}

    rows = [row("pyzmq 1 frame", 1.7), row("wire shm gpu->gpu", 33.0), row("wire cuda-ipc gpu->gpu", 120.0)]
    out = _summary(rows, cuda=True, wire_frame_kib=1024)
    assert out["faster_same_host_gpu_path"] == "cuda_ipc" and out["cuda_ipc_vs_shm_gpu_to_gpu"] == 3.64
    rows[-1] = row("wire cuda-ipc gpu->gpu", 20.0)
    assert _summary(rows, cuda=True, wire_frame_kib=1024)["faster_same_host_gpu_path"] == "shm"


# --- CUDA: across processes -------------------------------------------------------------------------------


def staged(ring: CudaIpcRing, seed: int, batch_id: int = 1):
    """A BATCH whose features (bf16) and scales (fp32) are views of one GPU ring slot."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(100, 64, generator=g).to(torch.bfloat16)
    scales = torch.rand(100, 2, generator=g)
    slot = ring.acquire(12800 + 800)
    f = slot.view((100, 64), torch.bfloat16)
    s = slot.view((100, 2), torch.float32, offset=12800)
    f.copy_(feats)
    s.copy_(scales)
    torch.cuda.synchronize()  # the producer waits for its copy into the slot before the header goes out
    tensors = {"input_ids": torch.arange(100), "features": f, "feature_scales": s}
    msg = Batch(batch_id=batch_id, epoch=0, sample_ids=[5], lengths=[100], tensors=tensors)
    return msg, slot, feats, scales


def _worker(address: str, offer: dict, device: str, conn, hang: bool) -> None:
    """Opens the ring, reads one BATCH onto ``device`` as a worker's unpack does, reports its bytes, then
    ACKs it and closes (or hangs, to be SIGKILLed while it holds the lease)."""
    ring = CudaIpcRing.attach(CudaIpcOffer.from_dict(offer))
    with WorkerEndpoint(address) as ep:
        ep.ring = ring
        ep.send(Heartbeat(time=0.0))
        msg = None
        while msg is None:
            msg = ep.recv(timeout_s=60)
        view = msg.tensors["features"]
        feats = view.to(device, non_blocking=True)
        scales = msg.tensors["feature_scales"].to(device, non_blocking=True)
        torch.cuda.synchronize(device)
        conn.send(
            {
                "view_device": str(view.device),
                "features": bytes(feats.cpu().view(torch.uint8).reshape(-1).numpy()),
                "scales": scales.cpu().tolist(),
            }
        )
        if hang:
            time.sleep(600)
        ep.send(Ack(batch_ids=[msg.batch_id], step=1))
        time.sleep(0.5)  # let the ACK leave before the socket closes
    ring.close()
    conn.send(ring.released)


def _spawn_worker(ep: ProducerEndpoint, ring: CudaIpcRing, *, hang: bool):
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(ep.address, ring.offer().to_dict(), RECV_DEVICE, child, hang))
    proc.start()
    got = ep.recv(timeout_s=120)
    assert got is not None and isinstance(got[1], Heartbeat), "the worker process did not connect"
    peer = got[0]
    return proc, conn, peer


def _expect(got: dict, feats: torch.Tensor, scales: torch.Tensor) -> None:
    assert got["features"] == bytes(feats.view(torch.uint8).reshape(-1).numpy())
    assert got["scales"] == scales.tolist()
    assert got["view_device"].startswith("cuda")  # the worker read GPU memory, not a host copy


@cuda
def test_ring_views_round_trip_in_process_and_name_slots():
    ring = CudaIpcRing.create(3, 64 << 10, "cuda:0")
    try:
        msg, slot, feats, scales = staged(ring, seed=1)
        frames = encode(msg, ring=ring)
        assert len(frames) == 1  # input_ids inline; features and scales by reference
        out = decode(frames, ring=ring)
        assert out.tensors["features"].data_ptr() == msg.tensors["features"].data_ptr()
        assert torch.equal(out.tensors["features"].cpu(), feats)
        with pytest.raises(ProtocolError, match="mapped no ring"):
            decode(frames)
        with pytest.raises(ProtocolError, match="outside the peer's ring"):
            encode(msg)  # a GPU tensor never goes as frames by accident
        with pytest.raises(RingUnavailable, match="process that made them"):
            CudaIpcRing.attach(ring.offer())
    finally:
        ring.close()
        ring.close()  # safe twice
    assert ring.released


@cuda
@pytest.mark.skipif(not shm_supported(), reason="memfd and /proc are Linux-only")
def test_workers_without_the_gpu_ring_get_one_host_copy_held_until_the_ack():
    ring = CudaIpcRing.create(2, 64 << 10, "cuda:0")
    shm = ShmRing.create(slots=2, slot_bytes=64 << 10, pin=True)
    try:
        msg, slot, feats, scales = staged(ring, seed=7)
        ready = ReadyBatch(plan=None, payload=msg, tokens=100, slot=slot)
        assert payload_for(ready, ring, shm) is msg  # a CUDA IPC worker gets the GPU slots by reference
        host = payload_for(ready, shm, shm)  # a shm worker: one copy into a shm slot, sent by reference
        assert shm.locate(host.tensors["features"]) is not None and shm.leased == 1
        assert torch.equal(host.tensors["features"], feats) and torch.equal(
            host.tensors["feature_scales"], scales
        )
        assert torch.equal(host.tensors["input_ids"], msg.tensors["input_ids"])
        assert payload_for(ready, None, shm) is host  # a redelivery to a frames worker reuses the copy
        assert len(encode(host)) == 2  # header (ids and the 800-byte scales inline) + features as a frame
        ready.release()  # the ACK frees the GPU slot and the host copy together
        assert ring.leased == 0 and shm.leased == 0
    finally:
        ring.close()
        shm.close()


@cuda
def test_worker_process_reads_the_gpu_slots_bit_exact():
    ring = CudaIpcRing.create(3, 64 << 10, "cuda:0")
    try:
        msg, _slot, feats, scales = staged(ring, seed=3)
        with ProducerEndpoint("tcp://127.0.0.1:0") as ep:
            proc, conn, peer = _spawn_worker(ep, ring, hang=False)
            ep.send(peer, msg, ring=ring)
            _expect(conn.recv(), feats, scales)
            assert conn.recv() is True  # the worker unmapped the ring on close
            proc.join(60)
        assert proc.exitcode == 0
    finally:
        ring.close()


@cuda
def test_acquire_blocks_while_every_gpu_slot_is_leased():
    ring = CudaIpcRing.create(2, 4096, "cuda:0")
    try:
        check_back_pressure(ring)
        assert ring.device.type == "cuda"
        oversized = ring.acquire(ring.slot_bytes + 1)  # private device memory: it travels as frames
        assert oversized.slot_id is None and oversized.buffer.device == ring.device
    finally:
        ring.close()


@cuda
def test_killed_workers_slot_stays_leased_until_the_redelivered_copy_is_acked():
    ring = CudaIpcRing.create(2, 64 << 10, "cuda:0")
    try:
        sched = BatchScheduler(plan_epoch=lambda e, x: [[0]], epochs=1)
        plan = sched.next_plan()
        msg, slot, feats, scales = staged(ring, seed=5, batch_id=plan.batch_id)
        sched.add_ready(ReadyBatch(plan=plan, payload=msg, tokens=100, slot=slot))
        with ProducerEndpoint("tcp://127.0.0.1:0") as ep:
            doomed, conn_a, peer_a = _spawn_worker(ep, ring, hang=True)
            ep.send(peer_a, sched.lease_next(peer_a, 0.0).payload, ring=ring)
            _expect(conn_a.recv(), feats, scales)
            os.kill(doomed.pid, signal.SIGKILL)
            doomed.join(30)
            assert ring.leased == 1 and sched.release(peer_a) == 1
            assert ring.leased == 1  # redelivered, never overwritten in between
            proc, conn_b, peer_b = _spawn_worker(ep, ring, hang=False)
            again = sched.lease_next(peer_b, 1.0)
            assert again.slot.slot_id == slot.slot_id
            ep.send(peer_b, again.payload, ring=ring)
            _expect(conn_b.recv(), feats, scales)  # the GPU memory outlived the killed worker
            ack = None
            while not isinstance(ack, Ack):
                got = ep.recv(timeout_s=60)
                assert got is not None, "no ACK from the second worker"
                ack = got[1]
            sched.ack(peer_b, ack.batch_ids)
            proc.join(60)
        assert sched.next_plan() is None  # the one epoch is planned out
        assert ring.leased == 0 and sched.finished()
        assert len({ring.acquire(10, timeout_s=1).slot_id for _ in range(2)}) == 2  # both slots came back
    finally:
        ring.close()


@cuda
@pytest.mark.slow
def test_tiny_launch_on_cuda_moves_batches_through_the_gpu_ring(tmp_path: Path):
    run_dir = tmp_path / "run"
    drafter_gpu = RECV_DEVICE.split(":")[1]
    cmd = [
        *(sys.executable, "-m", "dflash_pipe", "launch", "--plain", "--run-dir", str(run_dir)),
        *("--device", "cuda", "--target-gpus", "0", "--drafter-gpus", drafter_gpu),
        *("--payload-path", "cuda_ipc", "--compile", "off", "--draft-layers", "1"),
        *("--max-steps", "6", "--token-budget", "1024", "--max-length", "256"),
    ]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # keep site dirs
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    via = [r["batches_via_cuda_ipc"] for r in rows if "batches_via_cuda_ipc" in r]
    assert via and via[-1] >= 1, rows
    assert all(r.get("batches_via_shm", 0) == 0 for r in rows)
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*") if p.is_file())
    assert "cannot open the producer's CUDA IPC ring" not in logs + done.stderr
