from dflash_pipe.producer.scheduler import BatchScheduler, ReadyBatch


def plan_two_per_batch(epoch: int, exclude: set[int]) -> list[list[int]]:
    ids = [i for i in range(6) if i not in exclude]
    return [ids[i : i + 2] for i in range(0, len(ids), 2)]


def drain_plans(s: BatchScheduler) -> list:
    plans = []
    while (p := s.next_plan()) is not None:
        plans.append(p)
        s.add_ready(ReadyBatch(plan=p, payload=p.batch_id, tokens=10 * len(p.sample_ids)))
    return plans


def test_every_sample_once_per_epoch_and_finish_after_all_acks():
    s = BatchScheduler(plan_epoch=plan_two_per_batch, epochs=2)
    plans = drain_plans(s)
    assert [p.epoch for p in plans] == [0, 0, 0, 1, 1, 1]
    for epoch in (0, 1):
        ids = sorted(i for p in plans if p.epoch == epoch for i in p.sample_ids)
        assert ids == list(range(6))
    assert len({p.batch_id for p in plans}) == 6
    leased = [s.lease_next(b"w", 0.0) for _ in range(6)]
    assert s.lease_next(b"w", 0.0) is None
    assert not s.finished()
    s.ack(b"w", [b.plan.batch_id for b in leased[:5]])
    assert not s.finished()
    s.ack(b"w", [leased[5].plan.batch_id])
    assert s.finished()
    assert s.stats.acked == 6 and s.stats.acked_samples == 12 and s.stats.acked_tokens == 120


def test_release_returns_a_lost_workers_leases_first_in_order():
    s = BatchScheduler(plan_epoch=plan_two_per_batch, epochs=1)
    drain_plans(s)
    a1 = s.lease_next(b"a", 0.0)
    b1 = s.lease_next(b"b", 0.0)
    a2 = s.lease_next(b"a", 0.0)
    assert s.release(b"a") == 2
    assert s.stats.redelivered == 2
    again = [s.lease_next(b"b", 1.0) for _ in range(2)]
    assert [x.plan.batch_id for x in again] == [a1.plan.batch_id, a2.plan.batch_id]
    s.ack(b"b", [b1.plan.batch_id] + [x.plan.batch_id for x in again])
    assert s.finished()


def test_ack_from_wrong_worker_or_unknown_batch_is_counted_not_applied():
    s = BatchScheduler(plan_epoch=plan_two_per_batch, epochs=1)
    drain_plans(s)
    b = s.lease_next(b"a", 0.0)
    s.ack(b"intruder", [b.plan.batch_id, 999])
    assert s.stats.unknown_acks == 2 and s.leased_count() == 1


def test_resume_skips_trained_samples_of_the_start_epoch():
    s = BatchScheduler(
        plan_epoch=plan_two_per_batch, epochs=2, start_epoch=1, trained_in_start_epoch={0, 1, 2}
    )
    plans = drain_plans(s)
    assert all(p.epoch == 1 for p in plans)
    assert sorted(i for p in plans for i in p.sample_ids) == [3, 4, 5]


def test_released_samples_bound_the_duplicates_of_a_lost_worker():
    s = BatchScheduler(plan_epoch=plan_two_per_batch, epochs=1)
    drain_plans(s)
    s.lease_next(b"dead", 0.0)
    s.lease_next(b"dead", 0.0)
    kept = s.lease_next(b"alive", 0.0)
    assert s.release(b"dead") == 2
    assert s.stats.released_samples == 4
    assert s.release(b"alive") == 1  # the live worker's lease was kept; released now, it goes first
    assert s.lease_next(b"other", 0.0).plan.batch_id == kept.plan.batch_id
