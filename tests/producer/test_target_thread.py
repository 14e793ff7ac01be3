"""TargetThread: features land in staging slots, double-buffered, and never deadlock on a small ring."""

from __future__ import annotations

import queue
import time

import pytest
import torch
from transformers import Qwen3ForCausalLM

from dflash_pipe.data import Sample
from dflash_pipe.producer.scheduler import PlannedBatch
from dflash_pipe.producer.target_threads import TargetFailure, TargetThread
from dflash_pipe.target import TargetCore
from dflash_pipe.telemetry import RateMeter
from dflash_pipe.wire.shm import ShmRing
from dflash_pipe.wire.slots import PayloadSlot, PrivateStaging
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


class CountedRing:
    """The producer's real shared-memory ring (one slot here), its ``acquire`` timeouts counted: the
    target thread's flush path and its waiting loop show in ``timeouts``."""

    def __init__(self, slots: int, nbytes: int) -> None:
        self.ring = ShmRing.create(slots=slots, slot_bytes=nbytes, pin=False)
        self.timeouts = 0

    def acquire(self, nbytes: int, timeout_s: float | None = None) -> PayloadSlot:
        assert nbytes <= self.ring.slot_bytes, "the batch must fit a slot, else it gets private memory"
        try:
            return self.ring.acquire(nbytes, timeout_s)
        except TimeoutError:
            self.timeouts += 1
            raise

    def close(self) -> None:
        self.ring.close()


@pytest.fixture
def one_slot_ring(target_dir):
    """A one-slot ring that holds the features of any one sample."""
    core = TargetCore(target_dir, LAYERS, "cpu", torch.float32)
    ring = CountedRing(slots=1, nbytes=max(LENGTHS) * len(LAYERS) * core.hidden_size * 4)
    yield core, ring
    ring.close()


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


def test_one_slot_ring_does_not_deadlock(one_slot_ring, samples):
    """The thread holds its previous batch while it acquires the next slot: with one slot in the whole ring
    it must hand that batch over first instead of waiting forever."""
    core, ring = one_slot_ring
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


def slow_core(target_dir) -> tuple[TargetCore, list[int]]:
    """A target whose every forward takes 0.2 s (a big one), and the list its forwards append to."""
    core = TargetCore(target_dir, LAYERS, "cpu", torch.float32)
    started: list[int] = []
    real = core.features

    def slow(ids, lengths):
        started.append(1)
        time.sleep(0.2)
        return real(ids, lengths)

    core.features = slow
    return core, started


def test_stop_ends_the_thread_after_the_batch_it_computes(target_dir, samples):
    """stop() lets the batch in the forward finish and starts no other: the producer joins its target
    threads before it exits (a thread inside torch at interpreter exit aborts the process)."""
    core, started = slow_core(target_dir)
    plan_q: queue.Queue = queue.Queue()
    ready_q: queue.Queue = queue.Queue()
    for i in range(len(LENGTHS)):
        plan_q.put(PlannedBatch(batch_id=i, epoch=0, sample_ids=[i]))
    thread = TargetThread(core, samples, plan_q, ready_q, RateMeter(), name="cpu", staging=PrivateStaging())
    thread.start()
    ready_q.put(ready_q.get(timeout=30))  # the first batch is out: the thread is in a later forward
    thread.stop()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert len(started) < len(LENGTHS)  # queued plans were not started
    assert not any(isinstance(item, TargetFailure) for item in list(ready_q.queue))


def test_stop_ends_a_thread_waiting_for_a_staging_slot(one_slot_ring, samples):
    """Every slot leased (no worker ACKs any more): the thread waiting for one ends on stop(), silently."""
    core, ring = one_slot_ring
    plan_q: queue.Queue = queue.Queue()
    ready_q: queue.Queue = queue.Queue()
    for i in range(3):
        plan_q.put(PlannedBatch(batch_id=i, epoch=0, sample_ids=[i]))
    thread = TargetThread(core, samples, plan_q, ready_q, RateMeter(), name="cpu", staging=ring)
    thread.start()
    first = ready_q.get(timeout=30)  # holds the only slot, never released
    deadline = time.monotonic() + 10
    while ring.timeouts < 2 and time.monotonic() < deadline:  # the thread is in its waiting loop
        time.sleep(0.05)
    assert thread.is_alive() and ring.timeouts >= 2
    thread.stop()
    thread.join(timeout=5)
    assert not thread.is_alive() and ready_q.empty() and first.plan.batch_id == 0


def test_closing_the_producer_drops_queued_plans_and_joins_its_target_threads(target_dir, samples):
    from types import SimpleNamespace

    from dflash_pipe.producer.proc import ProducerProc

    core, started = slow_core(target_dir)
    plan_q: queue.Queue = queue.Queue()
    ready_q: queue.Queue = queue.Queue()
    for i in range(200):
        plan_q.put(PlannedBatch(batch_id=i, epoch=0, sample_ids=[i % len(LENGTHS)]))
    threads = [
        TargetThread(core, samples, plan_q, ready_q, RateMeter(), name=f"cpu{i}", staging=PrivateStaging())
        for i in range(2)
    ]
    for thread in threads:
        thread.start()
    ready_q.get(timeout=30)
    notes: list[str] = []
    producer = SimpleNamespace(
        _threads=threads, core=SimpleNamespace(leases=SimpleNamespace(plans=plan_q), note=notes.append)
    )
    ProducerProc._stop_targets(producer)
    assert not any(t.is_alive() for t in threads) and notes == []
    assert len(started) < 20 and plan_q.qsize() <= 2  # the 200 plans were dropped, not computed


class _SlowGenerator:
    """Finishes one conversation every 50 ms, polling ``should_stop`` in between (as the engine does after
    each decode step)."""

    def __init__(self) -> None:
        self.calls = 0

    def engine(self):
        return None

    def regenerate(self, items, should_stop=None, on_done=None, between=None):
        from dflash_pipe.data.regenerated import Regenerated
        from dflash_pipe.target.decode import GenerationStopped

        self.calls += 1
        for index, messages in items:
            for _ in range(5):
                time.sleep(0.01)
                if should_stop():
                    raise GenerationStopped
            on_done(Regenerated(index=index, messages=messages, turns=1))


def test_stop_generating_stops_the_job_at_once_skips_the_next_and_still_computes_batches(target_dir, samples):
    """A drain: the generation in progress ends at its next poll (its finished conversations were handed
    over), the queued job is not started, feature batches are still computed."""
    from dflash_pipe.producer.regen import GenerateDone, GenerateJob

    core = TargetCore(target_dir, LAYERS, "cpu", torch.float32)
    generator = _SlowGenerator()
    plan_q: queue.Queue = queue.Queue()
    ready_q: queue.Queue = queue.Queue()
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]
    plan_q.put(GenerateJob(job_id=1, items=[(i, conversation) for i in range(100)]))
    plan_q.put(GenerateJob(job_id=2, items=[(i, conversation) for i in range(100, 200)]))
    plan_q.put(PlannedBatch(batch_id=0, epoch=0, sample_ids=[0]))
    thread = TargetThread(
        core, samples, plan_q, ready_q, RateMeter(), name="cpu", staging=PrivateStaging(),
        make_generator=lambda _core: generator,
    )  # fmt: skip
    thread.start()
    first = ready_q.get(timeout=30)
    assert isinstance(first, GenerateDone) and first.results[0].index == 0
    started = time.monotonic()
    thread.stop_generating()
    batch = ready_q.get(timeout=30)
    while isinstance(batch, GenerateDone):  # conversations finished before the stop was heard
        assert batch.job.job_id == 1
        batch = ready_q.get(timeout=30)
    assert time.monotonic() - started < 5 and batch.plan.batch_id == 0
    plan_q.put(None)
    thread.join(timeout=10)
    assert not thread.is_alive() and generator.calls == 1 and ready_q.empty()
