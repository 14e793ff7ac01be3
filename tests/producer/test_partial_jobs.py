"""A generation job's conversations are answered one by one as they finish, so the first training batch
waits for a batch's worth of replies, not for the slowest conversation of the first job."""

from __future__ import annotations

import queue
from pathlib import Path

from dflash_pipe.data.regenerated import Regenerated
from dflash_pipe.producer.regen import GenerateDone, GenerateJob
from dflash_pipe.producer.scheduler import PlannedBatch
from dflash_pipe.producer.target_threads import _OpenJobs
from tests.producer.test_core_eval import _core, _queued


def _reply(index: int, conv: list[dict]) -> Regenerated:
    messages = [conv[0], {"role": "assistant", "content": f"the target says {index} " * 4}]
    return Regenerated(index=index, messages=messages, turns=1, new_tokens=6)


def test_each_conversation_is_answered_when_done_and_the_job_with_its_last():
    ready: queue.Queue = queue.Queue()
    jobs = _OpenJobs(ready, "cpu")
    first = GenerateJob(job_id=1, items=[(0, []), (1, [])])
    second = GenerateJob(job_id=2, items=[(5, [])])
    jobs.open(first)
    jobs.open(second)
    for index in (1, 5, 0):  # the slot engine finishes them in any order
        jobs.done(Regenerated(index=index, messages=[], turns=1))
    answers = [ready.get_nowait() for _ in range(3)]
    assert [(a.job.job_id, [r.index for r in a.results], a.last) for a in answers] == [
        (1, [1], False),
        (2, [5], True),
        (1, [0], True),
    ]
    assert answers[0].seconds == 0.0 and answers[2].seconds > 0.0  # the job's time, once
    assert ready.empty()


def test_training_starts_on_a_partly_answered_job(tmp_path: Path) -> None:
    core, _, _ = _core(tmp_path)
    core.refill()
    train_job, _ = _queued(core)
    assert core.leases.generating == 2
    done = [_reply(i, conv) for i, conv in train_job.items[:3]]  # 3 of its 4 conversations
    for record in done:
        core.leases.ready.put(
            GenerateDone(job=train_job, results=[record], seconds=0.0, replica="cpu", last=False)
        )
    core.take_ready()
    assert core.leases.generating == 2  # the job is still open on its replica
    assert sorted(core.leases.regen.store.done) == sorted(r.index for r in done)  # written, one flush
    core.refill()
    plans = [p for p in _queued(core) if isinstance(p, PlannedBatch)]
    assert plans and {i for p in plans for i in p.sample_ids} <= {r.index for r in done}
    last_index, last_conv = train_job.items[3]
    core.leases.ready.put(
        GenerateDone(job=train_job, results=[_reply(last_index, last_conv)], seconds=1.0, replica="cpu")
    )
    core.take_ready()
    assert core.leases.generating == 1 and core.leases.regen.generate_s == 1.0
