"""The control path of the wire: encode + decode of the small messages every step exchanges, per second.

Features move in frames or a shared ring (``bench transport``'s GB/s); what costs CPU besides them is the
header of every message: HEARTBEATs, READY credits, ACKs, METRICS, and the header of each BATCH (its fields
and tensor table). This times ``decode(encode(msg))`` of each in one process, on the CPU, no socket: the
codec's and the messages' own cost, which a change to either must not make slower.

``python -m dflash_pipe.bench.control`` prints the figures; ``bench transport`` adds them to its summary.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import torch


def control_messages() -> dict[str, Any]:
    """One typical message of each control kind (sizes as in a run of 16 samples a batch)."""
    from dflash_pipe.wire import Ack, Batch, Checkpoint, Heartbeat, Hello, Metrics, Ready

    lengths = [64] * 16
    total = sum(lengths)
    return {
        "HEARTBEAT": Heartbeat(time=time.time()),
        "READY": Ready(credits=2, shm=True),
        "ACK": Ack(batch_ids=[101, 102, 103, 104], step=250),
        "METRICS": Metrics(step=250, values={"loss": 1.25, "lr": 6e-4, "acc_per_slot": [0.5] * 7}),
        "CHECKPOINT": Checkpoint(step=250, path="/runs/r/checkpoints/step-250"),
        "HELLO": Hello(worker_name="w0", host="node-1", pid=4242, device="cuda:0", capabilities=["frames"]),
        "BATCH": Batch(  # its header: fields and a three-tensor table (tiny tensors, in raw frames)
            batch_id=7,
            epoch=1,
            sample_ids=list(range(100, 116)),
            lengths=lengths,
            tensors={
                "input_ids": torch.zeros(total, dtype=torch.int64),  # [T]
                "loss_mask": torch.ones(total, dtype=torch.bool),  # [T]
                "features": torch.zeros(total, 8, dtype=torch.bfloat16),  # [T, k*H], H tiny
            },
        ),
    }


def control_rate(seconds: float = 0.5) -> dict[str, Any]:
    """Messages per second through ``decode(encode(msg))`` for each kind, and over all kinds."""
    from dflash_pipe.wire import decode, encode

    per_kind: dict[str, float] = {}
    spent = count = 0.0
    for name, msg in control_messages().items():
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds:
            for _ in range(200):
                decode(encode(msg))
            n += 200
        per_kind[name] = round(n / elapsed)
        spent, count = spent + elapsed, count + n
    return {"control_msgs_per_s": round(count / spent), "control_msgs_per_s_by_kind": per_kind}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.5, help="time per message kind")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(json.dumps(control_rate(args.seconds), indent=2))


if __name__ == "__main__":
    main()
