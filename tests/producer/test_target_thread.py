"""TargetThread: features land in staging slots, double-buffered, and never deadlock on a small ring."""

from __future__ import annotations

import queue
import threading

import pytest
import torch
from transformers import Qwen3ForCausalLM

from dflash_pipe.data import Sample
from dflash_pipe.producer.features import TargetFailure, TargetThread
from dflash_pipe.producer.scheduler import PlannedBatch
from dflash_pipe.producer.staging import HostSlot, PrivateStaging
from dflash_pipe.target import TargetCore
from dflash_pipe.telemetry import RateMeter
from tests.tiny_models import tiny_qwen3_config

LAYERS = (0, 1)
LENGTHS = [5, 9, 3, 12, 7, 4]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3")
    Qwen3ForCausalLM(tiny_qwen3_config(num_hidden_layers=2)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def samples() -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    return [
        Sample(
            sample_id=i,
            input_ids=torch.randint(0, 60, (n,), generator=g),
            loss_mask=torch.ones(n, dtype=torch.bool),
        )
        for i, n in enumerate(LENGTHS)
    ]


class TinyRing:
    """A staging area of ``slots`` fixed slots that blocks (or times out) while all are leased."""

    def __init__(self, slots: int, nbytes: int) -> None:
        self.free = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(slots)]
        self.cond = threading.Condition()
        self.timeouts = 0

    def acquire(self, nbytes: int, timeout_s: float | None = None) -> HostSlot:
        with self.cond:
            if not self.cond.wait_for(lambda: self.free, timeout=timeout_s):
                self.timeouts += 1
                raise TimeoutError("every slot is leased")
            buffer = self.free.pop()
        return HostSlot(buffer=buffer, nbytes=nbytes, _on_release=self._give_back)

    def _give_back(self, slot: HostSlot) -> None:
        with self.cond:
            self.free.append(slot.buffer)
            self.cond.notify_all()

    def close(self) -> None:
        pass


def _run(core, samples, plans, staging, *, release: bool, stop: bool = True):
    plan_q: queue.Queue = queue.Queue()
    ready_q: queue.Queue = queue.Queue()
    for plan in plans:
        plan_q.put(plan)
    if stop:
        plan_q.put(None)
    rate = RateMeter()
    thread = TargetThread(core, samples, plan_q, ready_q, rate, name="cpu", staging=staging)
    thread.start()
    out = []
    for _ in plans:
        item = ready_q.get(timeout=60)
        assert not isinstance(item, TargetFailure), item.error
        out.append(item)
        if release:
            item.slot.release()  # what the scheduler does on the ACK
    return thread, out, rate, plan_q


def test_features_are_views_of_their_slots(target_dir, samples):
    core = TargetCore(target_dir, LAYERS, "cpu", torch.float32)
    plans = [
        PlannedBatch(batch_id=i, epoch=0, sample_ids=ids) for i, ids in enumerate([[0, 1], [2, 3, 4], [5]])
    ]
    staging = PrivateStaging()
    thread, ready, rate, _ = _run(core, samples, plans, staging, release=False)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert [r.plan.batch_id for r in ready] == [0, 1, 2]  # one thread keeps the plan order
    for r in ready:
        chosen = [samples[i] for i in r.plan.sample_ids]
        ids = torch.cat([s.input_ids for s in chosen])
        lengths = [len(s.input_ids) for s in chosen]
        feats = r.payload.tensors["features"]
        assert feats.data_ptr() == r.slot.buffer.data_ptr()  # the wire tensor IS the slot
        assert r.slot.nbytes == feats.numel() * feats.element_size()
        assert torch.equal(feats, core.features(ids, lengths))
        assert r.payload.lengths == lengths and r.tokens == sum(lengths)
    assert staging.live == 3
    for r in ready:
        r.slot.release()
    assert staging.live == 0
    assert rate.total == sum(LENGTHS)


def test_a_lone_plan_is_handed_over_without_waiting_for_the_next(target_dir, samples):
    """With no further plan queued, the pending batch goes out at once (workers may be waiting for it)."""
    core = TargetCore(target_dir, LAYERS, "cpu", torch.float32)
    thread, ready, _, plan_q = _run(
        core,
        samples,
        [PlannedBatch(batch_id=7, epoch=0, sample_ids=[1])],
        PrivateStaging(),
        release=True,
        stop=False,
    )
    assert ready[0].plan.batch_id == 7 and thread.is_alive()
    plan_q.put(None)
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_one_slot_ring_does_not_deadlock(target_dir, samples):
    """The thread holds its previous batch while it acquires the next slot: with one slot in the whole ring
    it must hand that batch over first instead of waiting forever."""
    core = TargetCore(target_dir, LAYERS, "cpu", torch.float32)
    width = len(LAYERS) * core.hidden_size * 4
    ring = TinyRing(slots=1, nbytes=max(LENGTHS) * 3 * width)
    plans = [PlannedBatch(batch_id=i, epoch=0, sample_ids=[i]) for i in range(len(LENGTHS))]
    thread, ready, _, _ = _run(core, samples, plans, ring, release=True)
    thread.join(timeout=30)
    assert [r.plan.batch_id for r in ready] == list(range(len(LENGTHS)))
    assert ring.timeouts >= 1  # the flush path ran


def test_failure_is_reported(target_dir, samples):
    core = TargetCore(target_dir, LAYERS, "cpu", torch.float32)
    plan_q: queue.Queue = queue.Queue()
    ready_q: queue.Queue = queue.Queue()
    plan_q.put(PlannedBatch(batch_id=0, epoch=0, sample_ids=[99]))  # no such sample
    TargetThread(core, samples, plan_q, ready_q, RateMeter(), name="cpu", staging=PrivateStaging()).start()
    item = ready_q.get(timeout=30)
    assert isinstance(item, TargetFailure) and isinstance(item.error, IndexError)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_copies_into_pinned_slots(target_dir, samples):
    core = TargetCore(target_dir, LAYERS, "cuda", torch.bfloat16)
    plans = [PlannedBatch(batch_id=i, epoch=0, sample_ids=[i, i + 1]) for i in range(len(LENGTHS) - 1)]
    thread, ready, _, _ = _run(core, samples, plans, PrivateStaging(), release=False)
    thread.join(timeout=60)
    for r in ready:
        feats = r.payload.tensors["features"]
        assert feats.device.type == "cpu" and feats.is_pinned()
        chosen = [samples[i] for i in r.plan.sample_ids]
        ids = torch.cat([s.input_ids for s in chosen])
        ref = core.features(ids, [len(s.input_ids) for s in chosen]).cpu()
        assert torch.equal(feats, ref)
