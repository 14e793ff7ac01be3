"""Target threads: one per target replica, turning planned batches into BATCH messages ahead of demand.

Each thread owns one ``TargetCore`` on its own GPU, so every target GPU works in parallel (torch releases
the GIL inside kernels). The producer's main thread never computes; it only routes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_pipe.data import Sample
from dflash_pipe.producer.scheduler import PlannedBatch, ReadyBatch
from dflash_pipe.target import TargetCore
from dflash_pipe.telemetry import RateMeter
from dflash_pipe.wire import messages as m
from dflash_pipe.wire.fp8 import wire_features


@dataclass(slots=True)
class TargetFailure:
    """Sent through the ready queue when a target thread dies, so the main thread can report it."""

    replica: str
    error: BaseException


def pack(samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    ids = torch.cat([s.input_ids for s in samples])  # [T]
    mask = torch.cat([s.loss_mask for s in samples])  # [T]
    return ids, mask, [int(s.input_ids.numel()) for s in samples]


def build_batch(
    core: TargetCore,
    plan: PlannedBatch,
    samples: Sequence[Sample],
    *,
    for_eval: bool = False,
    wire_dtype: str = "bf16",
) -> m.Batch:
    ids, mask, lengths = pack(samples)
    feats = core.features(ids, lengths)  # [T, k*H] on the target device
    wire = wire_features(feats, len(core.layer_ids), wire_dtype)  # fp8: quantised on the target device
    tensors = {"input_ids": ids, "loss_mask": mask.to(torch.uint8), **{k: v.cpu() for k, v in wire.items()}}
    if for_eval:
        tensors["target_next"] = core.greedy_next(ids, lengths).cpu()
    return m.Batch(
        batch_id=plan.batch_id,
        epoch=plan.epoch,
        sample_ids=list(plan.sample_ids),
        lengths=lengths,
        tensors=tensors,
        for_eval=for_eval,
    )


class TargetThread(threading.Thread):
    def __init__(
        self,
        core: TargetCore,
        samples: Sequence[Sample],
        plans: queue.Queue[PlannedBatch | None],
        ready: queue.Queue[ReadyBatch | TargetFailure],
        rate: RateMeter,
        name: str,
        wire_dtype: str = "bf16",
    ) -> None:
        super().__init__(name=f"target-{name}", daemon=True)
        self.core = core
        self.samples = samples
        self.plans = plans
        self.ready = ready
        self.rate = rate
        self.replica = name
        self.wire_dtype = wire_dtype
        self.busy_s = 0.0

    def run(self) -> None:
        import time

        try:
            while (plan := self.plans.get()) is not None:
                t0 = time.perf_counter()
                samples = [self.samples[i] for i in plan.sample_ids]
                batch = build_batch(self.core, plan, samples, wire_dtype=self.wire_dtype)
                tokens = sum(batch.lengths)
                self.busy_s += time.perf_counter() - t0
                self.rate.add(tokens)
                self.ready.put(ReadyBatch(plan=plan, payload=batch, tokens=tokens))
        except BaseException as exc:  # reported by the main thread, never swallowed
            self.ready.put(TargetFailure(replica=self.replica, error=exc))
