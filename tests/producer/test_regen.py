"""The producer's regeneration bookkeeping: jobs, samples from replies, epoch 0 planned as replies arrive."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_pipe.data import DataConfig, demo_tokenizer
from dflash_pipe.data.config import RegenConfig
from dflash_pipe.data.conversations import SourceConversations
from dflash_pipe.data.regenerated import Regenerated, RegenStore, TurnFailure, provenance
from dflash_pipe.data.render import render_conversation
from dflash_pipe.producer import failed_notes
from dflash_pipe.producer.regen import GenerateDone, GenerateJob, Regeneration, first_open_epoch
from dflash_pipe.run.ledger import Ledger

N = 12


@pytest.fixture(scope="module")
def tok():
    return demo_tokenizer()


def _conversations() -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"dataset {i}"}]
        for i in range(N)
    ]


def _make(tmp_path: Path, tok, *, budget: int = 64, batch: int = 4) -> Regeneration:
    data_file = tmp_path / "data.jsonl"
    if not data_file.exists():
        data_file.write_text("{}\n")
    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text("{}")
    data = DataConfig(path=data_file, token_budget=budget, max_length=64)
    settings = RegenConfig(batch_size=batch)
    store = RegenStore(tmp_path / "regen.jsonl", provenance(target, data, settings))
    source = SourceConversations(path=data_file, conversations=_conversations())
    return Regeneration(source, N - 2, store, settings, data, tok, seed=0)


def _answer(items, *, empty: set[int] = frozenset()) -> list[Regenerated]:
    out = []
    for index, messages in items:
        if index in empty:
            failure = TurnFailure(turn=0, reason="empty reply", skipped_turns=1)
            out.append(Regenerated(index=index, messages=[], failed=failure))
            continue
        reply = [messages[0], {"role": "assistant", "content": f"the target says {index} " * (1 + index % 3)}]
        out.append(Regenerated(index=index, messages=reply, turns=1, new_tokens=5))
    return out


def test_epoch0_plans_replies_as_they_arrive_and_every_sample_once(tmp_path, tok):
    regen = _make(tmp_path, tok)
    plans = regen.epoch0(set())
    assert next(plans) is None  # nothing generated yet
    planned: list[int] = []
    while (job := regen.next_job()) is not None:
        assert len(job.items) <= 4
        regen.accept(GenerateDone(job=job, results=_answer(job.items, empty={3}), seconds=0.1, replica="cpu"))
        while (batch := next(plans, "end")) not in (None, "end"):
            assert all(regen.train_samples[i] is not None for i in batch)  # only what exists is planned
            planned += batch
        if batch == "end":
            break
    planned += [i for batch in plans if batch is not None for i in batch]  # the rest, once complete
    assert regen.complete and regen.voids == {3}
    assert sorted(planned) == [i for i in range(N - 2) if i != 3]
    assert regen.tally.failed == {"empty reply": 1}
    # later epochs plan every sample but the void one
    later = [i for b in regen.later_epoch(1, set()) for i in b]
    assert sorted(later) == [i for i in range(N - 2) if i != 3]


def test_samples_are_rendered_from_the_regenerated_text(tmp_path, tok):
    regen = _make(tmp_path, tok)
    job = regen.next_job()
    (result, *_) = results = _answer(job.items)
    regen.accept(GenerateDone(job=job, results=results, seconds=0.1, replica="cpu"))
    ids, mask = render_conversation(tok, result.messages)
    sample = regen.train_samples[result.index]
    assert sample.input_ids.tolist() == ids and sample.loss_mask.tolist() == mask.tolist()


def test_a_reopened_run_reuses_what_was_written(tmp_path, tok):
    regen = _make(tmp_path, tok)
    job = regen.next_job()
    regen.accept(GenerateDone(job=job, results=_answer(job.items, empty={1}), seconds=0.1, replica="cpu"))
    regen.store.close()
    again = _make(tmp_path, tok)
    assert again.done == 4 and again.voids == {1} and again.reused == 4
    assert [i for i, _ in again.next_job().items] == [4, 5, 6, 7]  # nothing written is generated again
    first = [i for b in iter(again.epoch0({0}).__next__, None) for i in b]
    assert sorted(first) == [2, 3]  # 0 already trained this epoch, 1 void


def test_the_held_out_tail_is_regenerated_right_after_the_first_training_job(tmp_path, tok):
    regen = _make(tmp_path, tok)
    first, held_out, third = regen.next_job(), regen.next_job(), regen.next_job()
    assert all(i < N - 2 for i, _ in first.items) and all(i < N - 2 for i, _ in third.items)
    assert [i for i, _ in held_out.items] == [N - 2, N - 1]  # the eval tail, a job of its own
    regen.accept(GenerateDone(job=first, results=_answer(first.items), seconds=0.1, replica="cpu"))
    assert next(regen.epoch0(set())) is not None  # training is served before the eval set exists
    assert not regen.eval_ready and regen.status()["eval_done"] == 0
    with pytest.raises(RuntimeError, match="not regenerated yet"):
        regen.eval_samples()
    regen.accept(GenerateDone(job=held_out, results=_answer(held_out.items), seconds=0.1, replica="cpu"))
    assert regen.eval_ready and regen.status()["eval_done"] == regen.status()["eval_total"] == 2
    assert [s.sample_id for s in regen.eval_samples()] == [N - 2, N - 1]
    assert regen.done == len(first.items)  # held-out replies are not training samples
    regen.store.close()
    again = _make(tmp_path, tok)  # resumed: the held-out replies in the file are reused, not redone
    assert again.eval_ready and [s.sample_id for s in again.eval_samples()] == [N - 2, N - 1]
    jobs = []
    while (job := again.next_job()) is not None:
        jobs += [i for i, _ in job.items]
    assert sorted(jobs) == list(range(4, N - 2))  # only the training conversations not written


def test_a_killed_run_regenerates_the_held_out_set_it_lost(tmp_path, tok):
    regen = _make(tmp_path, tok)
    first, held_out = regen.next_job(), regen.next_job()
    regen.accept(GenerateDone(job=first, results=_answer(first.items), seconds=0.1, replica="cpu"))
    regen.store.close()  # killed while the held-out job was in flight: none of it was written
    again = _make(tmp_path, tok)
    assert not again.eval_ready and again.done == len(first.items)
    job = again.next_job()
    assert all(i < N - 2 for i, _ in job.items)  # a training job first, then the held-out set again
    assert [i for i, _ in again.next_job().items] == [i for i, _ in held_out.items]


def test_void_ids_count_as_trained_for_the_resume_epoch():
    ledger = Ledger(4, 3)
    ledger.mark(0, [0, 1, 3])
    assert first_open_epoch(ledger, set()) == 0
    assert first_open_epoch(ledger, {2}) == 1
    ledger.mark(1, [0])
    assert first_open_epoch(ledger, {2}) == 1


def test_jobs_group_conversations_of_similar_length_within_a_window(tmp_path, tok):
    regen = _make(tmp_path, tok, batch=2)
    for i, conv in enumerate(regen.source.conversations):  # longest first in the file
        conv[1]["content"] = "x" * (100 - i)
    jobs = []
    while (job := regen.next_job()) is not None:
        jobs.append([i for i, _ in job.items])
    # the 10 training conversations fit one window (8 jobs of 2): shortest first, each exactly once;
    assert jobs == [[9, 8], [10, 11], [7, 6], [5, 4], [3, 2], [1, 0]]  # the held-out pair second


def test_a_job_with_failed_turns_returns_the_dashboard_note(tmp_path, tok):
    regen = _make(tmp_path, tok)
    job = regen.next_job()
    assert regen.accept(GenerateDone(job=job, results=_answer(job.items), seconds=0.1, replica="cpu")) is None
    job = regen.next_job()  # the held-out pair
    assert regen.accept(GenerateDone(job=job, results=_answer(job.items), seconds=0.1, replica="cpu")) is None
    job = regen.next_job()
    note = regen.accept(
        GenerateDone(job=job, results=_answer(job.items, empty={5}), seconds=0.1, replica="cpu")
    )
    assert note == (
        "regeneration: 1 conversation(s) of job 3 stopped at a turn that could not be generated (first: "
        "conversation 5, turn 0: empty reply); their earlier turns are kept. So far: 1 empty reply"
    )


def test_failed_turns_are_said_at_most_once_per_interval_and_none_is_lost(tmp_path, tok, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(failed_notes.time, "monotonic", lambda: clock[0])
    regen = _make(tmp_path, tok, batch=2)
    notes = []
    while (job := regen.next_job()) is not None:
        every = {i for i, _ in job.items}
        notes.append(
            regen.accept(
                GenerateDone(job=job, results=_answer(job.items, empty=every), seconds=0.1, replica="cpu")
            )
        )
        clock[0] += 1.0
    said = [n for n in notes if n is not None]
    assert (
        len(notes) == 6 and len(said) == 1 and said[0].startswith("regeneration: 2 conversation(s) of job 1 ")
    )
    clock[0] += failed_notes.EVERY_S
    job = GenerateJob(job_id=99, items=[(0, regen.source.conversations[0])])
    late = regen.accept(
        GenerateDone(job=job, results=_answer(job.items, empty={0}), seconds=0.1, replica="cpu")
    )
    # the ten held back since the first note, and this one, in one line; the totals count every failure
    assert late.startswith("regeneration: 11 conversation(s) of 6 jobs (2-99) stopped")
    assert late.endswith("So far: 13 empty reply")


def test_no_trainable_sample_at_all_is_a_clear_error(tmp_path, tok):
    regen = _make(tmp_path, tok)
    while (job := regen.next_job()) is not None:
        assert regen.nothing_to_train() is None
        every = {i for i, _ in job.items}
        regen.accept(
            GenerateDone(job=job, results=_answer(job.items, empty=every), seconds=0.1, replica="cpu")
        )
    why = regen.nothing_to_train()
    # the reasons are the training conversations' own (not the held-out pair's), and hold on a resume
    assert why is not None and "all 10 training conversations" in why and "(10 empty reply)" in why
    assert regen.void_reasons == {"empty reply": 10}
    regen.store.close()
    again = _make(tmp_path, tok)  # the same run dir: every conversation read back from the file
    assert again.nothing_to_train() == why


def test_status_gives_the_share_of_target_time_spent_generating(tmp_path, tok):
    regen = _make(tmp_path, tok)
    assert regen.status(2)["target_share"] == 0.0  # nothing started
    job = regen.next_job()
    regen.started -= 10.0  # the first job went out 10 s ago
    regen.accept(GenerateDone(job=job, results=_answer(job.items), seconds=4.0, replica="cpu"))
    share = regen.status(2)["target_share"]  # 4 s of 2 replicas x 10 s
    assert 0.19 < share <= 0.2
    assert regen.status(1)["target_share"] == pytest.approx(2 * share, rel=0.01)


class _Core:
    device = "cpu"

    def __init__(self, slots: int):
        self.model = slots  # what the stand-in generator below reads


class _Generator:
    def __init__(self, slots: int, share: float):
        self.batch_size, self.share = slots, share


def test_auto_jobs_take_the_slots_the_replicas_got(tmp_path, tok, monkeypatch):
    """``--regen-batch`` auto: each replica's generator is built before the threads start (with the
    shared-GPU memory share when drafters train on the target's GPUs) and a job is as many conversations as
    the smallest replica has slots."""
    built: list[_Generator] = []

    def generator(model, tokenizer, settings, *, memory_share, **_):
        built.append(_Generator(model, memory_share))
        return built[-1]

    monkeypatch.setattr("dflash_pipe.target.generate.TurnGenerator", generator)
    regen = _make(tmp_path, tok, batch=0)
    note = regen.size_jobs([_Core(5), _Core(3)], drafters_share_gpus=True)
    assert "3 conversations a job" in note and [g.share for g in built] == [0.25, 0.25]
    assert [len(regen.next_job().items) for _ in range(3)] == [3, 2, 3]  # the 2 held-out ones second
    (tmp_path / "b").mkdir()
    explicit = _make(tmp_path / "b", tok, batch=4)
    assert explicit.size_jobs([_Core(5)], drafters_share_gpus=False) is None
    assert len(explicit.next_job().items) == 4


def test_the_summary_counts_conversations_trained_from_their_text(tmp_path, tok):
    """Records without the target's ids (here: all but one) are counted and said in the summary line."""
    from dflash_pipe.data.token_form import TokenForm
    from dflash_pipe.report import regen_line

    regen = _make(tmp_path, tok)
    job = regen.next_job()
    results = _answer(job.items, empty={job.items[1][0]})
    results[0].tokens = TokenForm([1, 2, 3, 4], [(2, 4)])
    regen.accept(GenerateDone(job=job, results=results, seconds=0.1, replica="cpu"))
    summary = regen.summary()
    assert summary["rendered_conversations"] == len(results) - 2  # not the one with ids, not the empty one
    assert f", {len(results) - 2} trained from their text re-tokenized" in regen_line(summary)
    assert "trained from their text" not in regen_line({**summary, "rendered_conversations": 0})
