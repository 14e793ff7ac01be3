"""Shared builders for the wire tests: one valid message of every kind."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.wire import (
    Ack,
    Batch,
    Bye,
    Checkpoint,
    Done,
    Error,
    Heartbeat,
    Hello,
    Message,
    Metrics,
    Plan,
    Ready,
    Redirect,
    Reject,
    Serving,
    Welcome,
)


def make_batch(
    lengths: list[int], hidden: int = 24, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> Batch:
    """A packed BATCH: input_ids [T] int64, loss_mask [T] bool, features [T, hidden]."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return Batch(
        batch_id=7,
        epoch=2,
        sample_ids=list(range(100, 100 + len(lengths))),
        lengths=lengths,
        tensors={
            "input_ids": torch.randint(0, 50_000, (total,), generator=g),  # [T]
            "loss_mask": torch.rand(total, generator=g) > 0.5,  # [T]
            "features": torch.randn(total, hidden, generator=g).to(dtype),  # [T, k*H]
        },
    )


def every_kind() -> list[Message]:
    return [
        Hello(worker_name="w0", host="node-1", pid=4242, device="cuda:0", capabilities=["flex", "bf16"]),
        Welcome(
            run_id="run-abc",
            rendezvous="tcp://127.0.0.1:29500",
            run_dir="/tmp/run",
            target_path="/models/qwen",
            drafter={"hidden_size": 4096, "rope_scaling": None, "ids": [1, 2], "nested": {"a": 1.5}},
            train={"lr": 6e-4, "betas": [0.9, 0.95], "compile": "auto"},
            resume_from=None,
            heartbeat_s=5.0,
            peer_timeout_s=60.0,
            num_samples=1000,
            credits=2,
            eval_batches=1,
        ),
        Reject(reason="protocol v2 != v1"),
        Ready(credits=2),
        make_batch([3, 5, 4]),
        Ack(batch_ids=[7, 8], step=12),
        Metrics(step=12, values={"loss": 1.25, "acc_per_slot": [0.0, 0.5, 0.25]}),
        Checkpoint(step=100, path="/tmp/run/ckpt/step-100"),
        Heartbeat(time=1_700_000_000.123456),
        Error(source="worker rank 1 (node-1:4242)", message="CUDA OOM", traceback="Traceback ...\n  x"),
        Done(reason="all epochs acked"),
        Bye(reason="SIGTERM"),
        Plan(
            batch_id=3,
            epoch=1,
            sample_ids=[5, 9],
            lengths=[2, 3],
            tensors={
                "input_ids": torch.arange(5),
                "loss_mask": torch.tensor([0, 1, 1, 0, 1], dtype=torch.uint8),
            },
        ),
        Serving(address="tcp://10.0.0.7:41234"),
        Redirect(producer="node1", address="ipc:///tmp/dflash/node1.sock", timeout_s=120.0),
    ]


@pytest.fixture
def messages() -> list[Message]:
    return every_kind()


@pytest.fixture
def batch_factory():
    """`make_batch` as a fixture (test modules must not import conftest: other packages have one too)."""
    return make_batch
