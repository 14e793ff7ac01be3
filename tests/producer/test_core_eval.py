"""The held-out set of a run on the target's responses, regenerated after serving has started: workers are
welcomed and trained at once, told the eval set is pending, and get its BATCHes once they exist; DONE waits
for it, so the final evaluation has it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from dflash_pipe.config.train import TrainConfig
from dflash_pipe.data import DataConfig, demo_tokenizer
from dflash_pipe.data.config import RegenConfig
from dflash_pipe.data.conversations import SourceConversations
from dflash_pipe.data.regenerated import Regenerated, RegenStore, provenance
from dflash_pipe.producer.core import ProducerCore
from dflash_pipe.producer.regen import GenerateDone, GenerateJob, Regeneration
from dflash_pipe.producer.rings import Rings
from dflash_pipe.producer.scheduler import PlannedBatch, ReadyBatch
from dflash_pipe.producer.setup import RunContext
from dflash_pipe.producer.target_threads import EvalDone, EvalJob
from dflash_pipe.run.config import RunConfig, WireConfig
from dflash_pipe.run.layout import LayoutConfig
from dflash_pipe.run.ledger import Ledger
from dflash_pipe.wire import messages as m
from tests.producer.test_core import Metrics, Outbox, _hello

N, HELD_OUT = 12, 2


def _core(tmp_path: Path) -> tuple[ProducerCore, Outbox, Metrics]:
    data_file = tmp_path / "data.jsonl"
    data_file.write_text("{}\n")
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    data = DataConfig(path=data_file, token_budget=64, max_length=64, responses="target")
    settings = RegenConfig(batch_size=4)
    conversations = [
        [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"dataset {i}"}]
        for i in range(N)
    ]
    regen = Regeneration(
        SourceConversations(path=data_file, conversations=conversations),
        N - HELD_OUT,
        RegenStore(tmp_path / "regen.jsonl", provenance(tmp_path / "target", data, settings)),
        settings,
        data,
        demo_tokenizer(),
        seed=0,
    )
    cfg = RunConfig(
        run_dir=tmp_path,
        data=data,
        regen=settings,
        train=TrainConfig(epochs=1, seed=0),
        wire=WireConfig(ready_batches=1, worker_credits=1, heartbeat_s=1.0, peer_timeout_s=5.0),
        layout=LayoutConfig(device="cpu", cpu_workers=2),
    )
    ctx = RunContext(
        cfg=cfg,
        run_id="run-1",
        target_path=tmp_path / "target",
        tokenizer=None,
        data=None,  # type: ignore[arg-type]
        train_samples=regen.train_samples,  # type: ignore[arg-type]
        eval_samples=[],
        drafter=SimpleNamespace(to_dict=lambda: {"hidden_size": 8}),  # type: ignore[arg-type]
        target_dtype=torch.float32,
        ledger=Ledger(N - HELD_OUT, 1),
        resume_from=None,
        resume_step=0,
        regen=regen,
    )
    out, metrics = Outbox(), Metrics()
    core = ProducerCore(
        ctx, out=out, metrics=metrics, rings=Rings(cuda=None, shm=None), host_id="h", rendezvous="tcp://r:1"
    )
    core.leases.targets_started(1, jobs_per_thread=2)
    return core, out, metrics


def _queued(core: ProducerCore) -> list[Any]:
    items = []
    while not core.leases.plans.empty():
        items.append(core.leases.plans.get_nowait())
    return items


def _answer(job: GenerateJob) -> GenerateDone:
    results = [
        Regenerated(
            index=i,
            messages=[conv[0], {"role": "assistant", "content": f"the target says {i}"}],
            turns=1,
            new_tokens=4,
        )
        for i, conv in job.items
    ]
    return GenerateDone(job=job, results=results, seconds=0.1, replica="cpu")


def _computed(core: ProducerCore, plan: PlannedBatch) -> ReadyBatch:
    samples = [core.ctx.train_samples[i] for i in plan.sample_ids]
    lengths = [int(s.input_ids.numel()) for s in samples]
    payload = m.Batch(
        batch_id=plan.batch_id,
        epoch=plan.epoch,
        sample_ids=plan.sample_ids,
        lengths=lengths,
        tensors={"input_ids": torch.cat([s.input_ids for s in samples])},
    )
    return ReadyBatch(plan=plan, payload=payload, tokens=sum(lengths))


def _eval_batch(samples: list) -> m.Batch:
    return m.Batch(
        batch_id=0,
        epoch=0,
        sample_ids=[s.sample_id for s in samples],
        lengths=[int(s.input_ids.numel()) for s in samples],
        tensors={"input_ids": torch.cat([s.input_ids for s in samples])},
        for_eval=True,
        eval_set=1,
    )


def test_training_starts_before_the_held_out_set_which_every_worker_gets_later(tmp_path: Path) -> None:
    core, out, metrics = _core(tmp_path)
    core.refill()
    core.handle(b"a", _hello("a"))
    (welcome,) = out.of(b"a", m.Welcome)
    assert welcome.eval_pending and welcome.eval_batches == 0
    train_job, held_out_job = _queued(core)
    assert [i for i, _ in held_out_job.items] == [N - 2, N - 1]  # second, right behind the first job

    core.leases.ready.put(_answer(train_job))  # the training replies come first
    core.take_ready()
    core.refill()
    plans = _queued(core)
    assert plans and all(isinstance(p, (PlannedBatch, GenerateJob)) for p in plans)  # no EvalJob yet
    for plan in plans:
        if isinstance(plan, PlannedBatch):
            core.leases.ready.put(_computed(core, plan))
    core.take_ready()
    core.handle(b"a", m.Ready(credits=1))
    core.dispatch()
    assert len(out.of(b"a", m.Batch)) == 1 and core.leases.eval_pending  # trains without the eval set

    core.handle(b"a", m.Metrics(step=1, values={"eval/skipped": 1.0}))  # an evaluation came due
    assert any("evaluation skipped" in n and "0/2 held-out" in n for n in core.account.messages)
    assert metrics.records[-1][0]["eval/skipped"] == 1.0

    core.leases.ready.put(_answer(held_out_job))
    core.take_ready()
    core.refill()
    (eval_job,) = [p for p in _queued(core) if isinstance(p, EvalJob)]
    assert [s.sample_id for s in eval_job.samples] == [N - 2, N - 1]
    assert core.leases.eval_pending and not core.finished()
    core.leases.ready.put(EvalDone(batches=[_eval_batch(eval_job.samples)], seconds=0.1))
    core.take_ready()
    assert not core.leases.eval_pending
    (late,) = [b for b in out.of(b"a", m.Batch) if b.for_eval]
    assert late.sample_ids == [N - 2, N - 1] and late.eval_set == 1
    assert any("eval set ready: 2 held-out sample(s)" in n for n in core.account.messages)

    core.handle(b"b", _hello("b"))  # joins after: the eval set with its WELCOME, as on dataset responses
    (welcome_b,) = out.of(b"b", m.Welcome)
    assert not welcome_b.eval_pending and welcome_b.eval_batches == 1
    assert [b.sample_ids for b in out.of(b"b", m.Batch)] == [[N - 2, N - 1]]


def test_done_waits_for_the_held_out_set(tmp_path: Path) -> None:
    core, out, _ = _core(tmp_path)
    core.handle(b"a", _hello("a"))
    held_out: GenerateJob | None = None
    acked: set[int] = set()
    for step in range(1, 100):  # every training job answered and every batch acked; the held-out job not
        core.refill()
        for item in _queued(core):
            if isinstance(item, GenerateJob) and item.items[0][0] >= N - HELD_OUT:
                held_out = item
            elif isinstance(item, GenerateJob):
                core.leases.ready.put(_answer(item))
            else:
                core.leases.ready.put(_computed(core, item))
        core.take_ready()
        core.handle(b"a", m.Ready(credits=1))
        core.dispatch()
        for batch in out.of(b"a", m.Batch):
            if batch.batch_id not in acked:
                acked.add(batch.batch_id)
                core.handle(b"a", m.Ack(batch_ids=[batch.batch_id], step=step))
        if core.leases.scheduler.finished():
            break
    assert core.leases.scheduler.finished() and held_out is not None
    assert not core.finished()  # no DONE before the held-out set
    assert any("waiting for the held-out set before DONE" in n for n in core.account.messages)
    core.leases.ready.put(_answer(held_out))
    core.take_ready()
    core.refill()
    (eval_job,) = _queued(core)
    core.leases.ready.put(EvalDone(batches=[_eval_batch(eval_job.samples)], seconds=0.1))
    core.take_ready()
    assert core.finished() and [b.for_eval for b in out.of(b"a", m.Batch)][-1]
