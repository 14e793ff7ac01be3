"""`dflash-pipe bench transport`: every way features can move from the producer to a worker, side by side.

Each case moves ``iters`` payloads of one size from a sender (this process) to a receiver (one spawned
process, as in real life), with a window of ``WINDOW`` unacknowledged payloads like the credit flow. The
receiver ends every payload with the bytes in a buffer of its own (its device on CUDA), as a worker does, and
acknowledges it. Paths:

- ``memcpy``: one host copy of the same bytes in one process: the ceiling of any host path.
- ``pyzmq 1 frame``: plain pyzmq (PAIR, ``copy=False``), the payload as one frame.
- ``pyzmq frames``: the same cut into frames of each size in ``frame_kib`` (the best one is the baseline).
- ``wire tcp`` / ``wire ipc``: our codec and endpoints with ``frame_bytes`` frames (a remote worker's path).
- ``wire shm``: our same-host path: the BATCH header names a ring slot, the receiver copies from the slot.
- with CUDA: ``d2h pinned`` (device to pinned host, the GPU-side ceiling), and ``wire shm`` / ``wire ipc``
  end to end from a GPU tensor on the sender to a GPU tensor on the receiver (``gpu->gpu``);
  ``wire cuda-ipc gpu->gpu``: the sender copies into a slot of its GPU ring (``wire.cuda_ipc``), the
  receiver copies from it to its own GPU (the same GPU with one, cuda:1 with several); and ``d2d`` (one
  device-to-device copy in one process, that path's ceiling).

The summary also holds the control path (``bench.control``): encode + decode of the small messages per
second, on the CPU. ``python -m dflash_pipe.bench.transport --out DIR`` runs it alone and writes DIR/transport.json.
Plain pyzmq is imported here only to measure the baseline; the product's sockets live in ``wire.transport``.

Past 400 lines because each transport path (tcp, ipc, shared memory, CUDA IPC) has its peer process and
its row of the summary here, side by side.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dflash_pipe.bench.control import control_rate
from dflash_pipe.bench.result import BenchResult

WINDOW = 4
"""Payloads in flight (sent, not yet acknowledged), like a worker's credits."""
MIB = 1 << 20


def _iters_for(nbytes: int, budget_bytes: int, minimum: int = 3) -> int:
    return max(minimum, budget_bytes // nbytes)


# ---------------------------------------------------------------------------------------------------------
# receiver (spawned process): obeys commands from the control pipe


def _receiver(conn: Any) -> None:
    import zmq

    from dflash_pipe.wire import Ack, Heartbeat
    from dflash_pipe.wire.cuda_ipc import CudaIpcOffer, CudaIpcRing
    from dflash_pipe.wire.shm import RingOffer, ShmRing
    from dflash_pipe.wire.transport import WorkerEndpoint

    torch.set_num_threads(1)
    conn.send("up")
    while (cmd := conn.recv()) is not None:
        kind, address, count, nbytes, opts = cmd
        device = torch.device(opts.get("device", "cpu"))
        dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if kind == "zmq":
            ctx = zmq.Context()
            sock = ctx.socket(zmq.PAIR)
            sock.connect(address)
            conn.send("ready")
            for _ in range(count):
                at = 0
                for frame in sock.recv_multipart(copy=False):
                    view = torch.frombuffer(frame.buffer, dtype=torch.uint8)
                    dest[at : at + view.numel()].copy_(view)
                    at += view.numel()
                sock.send(b"")
            sock.close(linger=1000)
            ctx.term()
        else:
            ring = None
            if opts.get("cuda_ring"):
                ring = CudaIpcRing.attach(CudaIpcOffer.from_dict(opts["cuda_ring"]))
            elif opts.get("ring"):
                ring = ShmRing.attach(RingOffer.from_dict(opts["ring"]), pin=device.type == "cuda")
            with WorkerEndpoint(address) as ep:
                ep.ring = ring
                ep.alloc = lambda n, d=dest: d  # frames land straight in the destination (device) buffer
                ep.send(Heartbeat(time=0.0))  # lets the ROUTER learn our routing id
                conn.send("ready")
                for _ in range(count):
                    msg = None
                    while msg is None:
                        msg = ep.recv(timeout_s=60)
                    got = msg.tensors["features"].view(torch.uint8).reshape(-1)
                    if got.data_ptr() != dest.data_ptr():  # a ring slot (or one small frame)
                        dest.copy_(got, non_blocking=True)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    ep.send(Ack(batch_ids=[msg.batch_id], step=0))
            if ring is not None:
                ring.close()
        conn.send("done")


# ---------------------------------------------------------------------------------------------------------
# sender side


def _pump(count: int, send: Callable[[int], None], wait_ack: Callable[[], None]) -> float:
    """Sends `count` payloads with at most WINDOW unacknowledged; returns the seconds until the last ACK."""
    start = time.perf_counter()
    outstanding: deque[int] = deque()
    for i in range(count):
        if len(outstanding) == WINDOW:
            wait_ack()
            outstanding.popleft()
        send(i)
        outstanding.append(i)
    while outstanding:
        wait_ack()
        outstanding.popleft()
    return time.perf_counter() - start


def _plain_zmq(conn: Any, address: str, payload: torch.Tensor, frame_bytes: int | None, count: int) -> float:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.bind(address)
    data = memoryview(payload.numpy())
    if frame_bytes is None:
        frames = [data]
    else:
        frames = [data[i : i + frame_bytes] for i in range(0, data.nbytes, frame_bytes)]
    conn.send(("zmq", sock.getsockopt_string(zmq.LAST_ENDPOINT), count + 1, payload.numel(), {}))
    assert conn.recv() == "ready"

    def send(_i: int) -> None:
        sock.send_multipart(frames, copy=False)

    send(0)
    sock.recv()  # one warm-up round trip
    seconds = _pump(count, send, sock.recv)
    assert conn.recv() == "done"
    sock.close(linger=1000)
    ctx.term()
    return seconds


def _wire(
    conn: Any,
    address: str,
    nbytes: int,
    count: int,
    *,
    frame_bytes: int,
    shm: bool,
    device: str,
    receiver_device: str,
    cuda_ipc: bool = False,
) -> float:
    """Our endpoints; on CUDA each payload starts on the sender's GPU and is copied device-to-host first
    (into a ring slot, or a pinned private buffer), as the producer does; with ``cuda_ipc``
    device-to-device into a slot of the GPU ring instead."""
    from dflash_pipe.wire import Batch
    from dflash_pipe.wire.cuda_ipc import CudaIpcRing
    from dflash_pipe.wire.shm import ShmRing
    from dflash_pipe.wire.transport import ProducerEndpoint

    cuda = device.startswith("cuda")
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    ring: Any = None
    if cuda_ipc:
        ring = CudaIpcRing.create(WINDOW + 1, nbytes, device)
    elif shm:
        ring = ShmRing.create(WINDOW + 1, nbytes, pin=cuda)
    private = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(WINDOW + 1)]
    if not cuda:  # CPU: the bytes are already staged (the device-to-host copy is not part of the path)
        for buf in private:
            buf.copy_(source)
    leases: deque[Any] = deque()
    ep = ProducerEndpoint(address, frame_bytes=frame_bytes)
    opts = {
        "device": receiver_device,
        ("cuda_ring" if cuda_ipc else "ring"): ring.offer().to_dict() if ring else None,
    }
    conn.send(("wire", ep.address, count + 1, nbytes, opts))
    got = ep.recv(timeout_s=120)
    if got is None:
        raise RuntimeError("the bench receiver did not connect within 120 s")
    peer = got[0]
    assert conn.recv() == "ready"

    def send(i: int) -> None:
        if ring is not None:
            slot = ring.acquire(nbytes)
            leases.append(slot)
            buf = slot.view((nbytes,), torch.uint8)
            if cuda or i == 0 or slot.slot_id is None:
                buf.copy_(source, non_blocking=cuda)
        else:
            buf = private[i % len(private)]
            if cuda:
                buf.copy_(source, non_blocking=True)
        if cuda:
            torch.cuda.synchronize()
        msg = Batch(batch_id=i, epoch=0, sample_ids=[], lengths=[], tensors={"features": buf})
        ep.send(peer, msg, ring=ring)

    def wait_ack() -> None:
        while ep.recv(timeout_s=60) is None:
            pass
        if leases:
            leases.popleft().release()

    if ring is not None and not cuda:  # stage once per slot, as the device-to-host copy would
        for slot in [ring.acquire(nbytes) for _ in range(ring.slots)]:
            slot.view((nbytes,), torch.uint8).copy_(source)
            slot.release()
    send(0)
    wait_ack()
    seconds = _pump(count, lambda i: send(i + 1), wait_ack)
    assert conn.recv() == "done"
    ep.close()
    if ring is not None:
        ring.close()
    return seconds


def _memcpy(nbytes: int, count: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(count):
        dst.copy_(src)
    return time.perf_counter() - start


def _d2d(nbytes: int, count: int) -> float:
    return _from_gpu(nbytes, count, pinned_host=False)


def _d2h(nbytes: int, count: int) -> float:
    return _from_gpu(nbytes, count, pinned_host=True)


def _from_gpu(nbytes: int, count: int, *, pinned_host: bool) -> float:
    """Seconds for ``count`` copies of ``nbytes`` from the GPU to pinned host memory or to the same GPU."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if pinned_host else torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------------


def run_transport_bench(
    sizes_mib: Sequence[float] = (1, 16, 126),
    *,
    frame_kib: Sequence[int] = (256, 1024, 2048, 4096, 16384),
    wire_frame_bytes: int | None = None,
    budget_mib: int = 384,
    cuda: bool | None = None,
) -> BenchResult:
    """Measures every path at every size; ``budget_mib``: bytes moved per case (at least 3 payloads).

    Defaults finish in about 30 s on 2 CPU cores. ``cuda`` (default: when available) adds the GPU cases."""
    from dflash_pipe.wire.shm import shm_supported
    from dflash_pipe.wire.transport import DEFAULT_FRAME_BYTES

    cuda = torch.cuda.is_available() if cuda is None else cuda
    wire_frame_bytes = wire_frame_bytes or DEFAULT_FRAME_BYTES
    recv_device = "cuda:1" if cuda and torch.cuda.device_count() > 1 else "cuda:0"
    rows: list[dict[str, Any]] = []
    spawn = mp.get_context("spawn")
    conn, child = spawn.Pipe()
    proc = spawn.Process(target=_receiver, args=(child,), daemon=True)
    proc.start()
    if conn.recv() != "up":  # measure nothing while the receiver is still importing torch
        raise RuntimeError("the bench receiver failed to start")
    tmp = tempfile.TemporaryDirectory(prefix="dflash-bench-")

    def row(path: str, size: int, seconds: float, count: int, frame: int | None) -> None:
        rows.append(
            {
                "path": path,
                "size_mib": round(size / MIB, 3),
                "frame_kib": None if frame is None else frame // 1024,
                "iters": count,
                "gb_per_s": round(size * count / seconds / 1e9, 3),
            }
        )

    try:
        for mib in sizes_mib:
            size = int(mib * MIB)
            count = _iters_for(size, budget_mib * MIB)
            row("memcpy", size, _memcpy(size, count), count, None)
            payload = torch.randint(0, 255, (size,), dtype=torch.uint8)
            row(
                "pyzmq 1 frame",
                size,
                _plain_zmq(conn, f"ipc://{tmp.name}/z", payload, None, count),
                count,
                None,
            )
            for kib in frame_kib:
                if kib * 1024 < size:
                    secs = _plain_zmq(conn, f"ipc://{tmp.name}/z", payload, kib * 1024, count)
                    row("pyzmq frames", size, secs, count, kib * 1024)
            common = {"frame_bytes": wire_frame_bytes, "device": "cpu", "receiver_device": "cpu"}
            for path, address in (("wire tcp", "tcp://127.0.0.1:0"), ("wire ipc", f"ipc://{tmp.name}/w")):
                row(
                    path,
                    size,
                    _wire(conn, address, size, count, shm=False, **common),
                    count,
                    wire_frame_bytes,
                )
            if shm_supported():
                row(
                    "wire shm",
                    size,
                    _wire(conn, f"ipc://{tmp.name}/s", size, count, shm=True, **common),
                    count,
                    None,
                )
            if cuda:
                row("d2h pinned", size, _d2h(size, count), count, None)
                gpu = {"frame_bytes": wire_frame_bytes, "device": "cuda:0", "receiver_device": recv_device}
                secs = _wire(conn, f"ipc://{tmp.name}/g", size, count, shm=False, **gpu)
                row("wire ipc gpu->gpu", size, secs, count, wire_frame_bytes)
                if shm_supported():
                    secs = _wire(conn, f"ipc://{tmp.name}/h", size, count, shm=True, **gpu)
                    row("wire shm gpu->gpu", size, secs, count, None)
                row("d2d", size, _d2d(size, count), count, None)
                secs = _wire(conn, f"ipc://{tmp.name}/c", size, count, shm=False, cuda_ipc=True, **gpu)
                row("wire cuda-ipc gpu->gpu", size, secs, count, None)
    finally:
        conn.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        tmp.cleanup()
    return BenchResult(
        name="transport",
        config={
            "sizes_mib": list(sizes_mib),
            "frame_kib": list(frame_kib),
            "wire_frame_bytes": wire_frame_bytes,
            "budget_mib": budget_mib,
            "window": WINDOW,
            "cuda": cuda,
            "receiver_device": recv_device if cuda else "cpu",
            "torch": torch.__version__,
        },
        rows=rows,
        summary={**_summary(rows, cuda, wire_frame_bytes // 1024), **control_rate()},
        chart={"x": "size_mib", "y": "gb_per_s", "group": "path", "title": "Transport GB/s by payload size"},
    )


def _summary(rows: list[dict[str, Any]], cuda: bool, wire_frame_kib: int) -> dict[str, Any]:
    """Headline figures at the largest size, the best plain-pyzmq frame size, and the two goals."""
    largest = max(r["size_mib"] for r in rows)
    at = [r for r in rows if r["size_mib"] == largest]

    def best(path: str) -> dict[str, Any] | None:
        hits = [r for r in at if r["path"] == path]
        return max(hits, key=lambda r: r["gb_per_s"]) if hits else None

    plain = max((r for r in at if r["path"].startswith("pyzmq")), key=lambda r: r["gb_per_s"])
    framed = [r for r in rows if r["path"] == "pyzmq frames" and r["size_mib"] == largest]
    out: dict[str, Any] = {
        "size_mib": largest,
        "best_plain_pyzmq_gb_per_s": plain["gb_per_s"],
        "best_plain_pyzmq_frame_kib": plain["frame_kib"],
        "fastest_frame_kib": max(framed, key=lambda r: r["gb_per_s"])["frame_kib"] if framed else None,
    }
    same = [r for r in framed if r["frame_kib"] == wire_frame_kib]
    wire = best("wire ipc")
    if same and wire:  # what our codec and transport cost over raw pyzmq, same socket kind and frames
        out["wire_vs_pyzmq_same_frames"] = round(wire["gb_per_s"] / same[0]["gb_per_s"], 3)
        out["goal_wire_overhead_5pct"] = out["wire_vs_pyzmq_same_frames"] >= 0.95
    if shm := best("wire shm"):
        out["shm_gb_per_s"] = shm["gb_per_s"]
        out["shm_vs_best_plain_pyzmq"] = round(shm["gb_per_s"] / plain["gb_per_s"], 2)
        out["goal_shm_2x_plain_pyzmq"] = out["shm_vs_best_plain_pyzmq"] >= 2.0
    if cuda and (g := best("wire shm gpu->gpu")):
        out["shm_gpu_to_gpu_gb_per_s"] = g["gb_per_s"]
        out["goal_gpu_to_gpu_25_gb_per_s"] = g["gb_per_s"] >= 25.0
    if cuda and (c := best("wire cuda-ipc gpu->gpu")):
        out["cuda_ipc_gpu_to_gpu_gb_per_s"] = c["gb_per_s"]
        out.update(_faster_same_host_gpu_path(c, best("wire shm gpu->gpu")))
    return out


def _faster_same_host_gpu_path(cuda_ipc: dict[str, Any], shm: dict[str, Any] | None) -> dict[str, Any]:
    """Which same-host GPU -> GPU path moves the largest payload faster (keep cuda_ipc only if it wins)."""
    if shm is None:
        return {"faster_same_host_gpu_path": "cuda_ipc"}
    return {
        "cuda_ipc_vs_shm_gpu_to_gpu": round(cuda_ipc["gb_per_s"] / shm["gb_per_s"], 2),
        "faster_same_host_gpu_path": "cuda_ipc" if cuda_ipc["gb_per_s"] > shm["gb_per_s"] else "shm",
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for transport.json")
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 126])
    parser.add_argument("--frame-kib", type=int, nargs="+", default=[256, 1024, 2048, 4096, 16384])
    parser.add_argument("--budget-mib", type=int, default=384, help="bytes moved per case")
    parser.add_argument("--no-cuda", action="store_true", help="skip the GPU cases")
    args = parser.parse_args(argv)
    result = run_transport_bench(
        args.sizes_mib,
        frame_kib=args.frame_kib,
        budget_mib=args.budget_mib,
        cuda=False if args.no_cuda else None,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "transport.json"
    path.write_text(
        json.dumps(
            {"name": result.name, "config": result.config, "rows": result.rows, "summary": result.summary},
            indent=2,
        )
        + "\n"
    )
    for r in result.rows:
        print(
            f"{r['path']:<20} {r['size_mib']:>8.1f} MiB  frame {str(r['frame_kib']):>6} KiB  {r['gb_per_s']:>7.2f} GB/s"
        )
    print(json.dumps(result.summary, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
