"""The worker loop under ``--min-workers 4``: while the group holds fewer drafters it takes no step and
acknowledges nothing (the batches wait), it says so once in its log and, as rank 0, to the producer at each
new count; at four it trains the batches it kept, and a member lost afterwards does not stop it."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import torch

from dflash_pipe.config.train import TrainConfig
from dflash_pipe.run.ledger import Ledger
from dflash_pipe.train.distributed import StepVote
from dflash_pipe.wire import messages as m
from dflash_pipe.worker.loop import WorkerSession, run_training
from dflash_pipe.worker.step import zero_totals

BLOCK = 4


class Link:
    def __init__(self, batches: list[m.Batch]) -> None:
        self.inbox: deque = deque(batches)
        self.sent: list = []

    def get(self, timeout_s: float):
        return self.inbox.popleft() if self.inbox else None

    def send(self, msg) -> None:
        self.sent.append(msg)


class ScriptedGroup:
    """Rank 0 of a group whose size per vote follows ``sizes``; then the producer says DONE."""

    def __init__(self, sizes: list[int], link: Link) -> None:
        self.sizes, self.link = deque(sizes), link
        self.rank, self.world_size, self.generation = 0, 1, 1
        self.started = False

    def vote(self, *, has_batch: bool, stop: bool, leave: bool, num_ids: int, drafters: int) -> StepVote:
        size = self.sizes.popleft() if self.sizes else 1
        if not self.sizes:
            self.link.inbox.append(m.Done(reason="all epochs trained"))
        self.world_size = size
        return StepVote(
            active=int(has_batch),
            stop=stop,
            counts=[num_ids] + [0] * (size - 1),
            leaving=[False] * size,
            waiting=0,
            drafters=size,
            started=self.started,
        )

    def mark_started(self) -> None:
        self.started = True

    def gather_ids(self, pairs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return pairs

    def sum_vector(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def sum_gradients(self, params) -> None:
        for p in params:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad


class Replicas:
    width = 1

    def local_pass(self, s, batches):
        return zero_totals(BLOCK)

    def sync(self) -> None:
        return None


def _batch(i: int) -> m.Batch:
    return m.Batch(batch_id=i, epoch=0, sample_ids=[i], lengths=[3], tensors={})


def _session(link: Link, group: ScriptedGroup, *, samples: int, train: TrainConfig, run_dir: Path):
    model = torch.nn.Linear(2, 2)
    return WorkerSession(
        link=link,
        group=group,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        ledger=Ledger(samples, 1),
        train=train,
        drafter_config={},
        run_dir=run_dir,
        device=torch.device("cpu"),
        block_size=BLOCK,
        replicas=Replicas(),
    )


def test_no_step_and_no_ack_until_four_then_the_kept_batches_train(tmp_path: Path, capsys):
    link = Link([_batch(i) for i in range(3)])
    # votes: 2 in, 2 in, 3 in (waiting), 4 in (first step), then a node lost (2 in): steps go on
    group = ScriptedGroup([2, 2, 3, 4, 2, 2, 2], link)
    s = _session(
        link, group, samples=3, train=TrainConfig(min_workers=4, eval_generate="off"), run_dir=tmp_path
    )
    result = run_training(s, lambda: False)
    first_ack = next(i for i, msg in enumerate(link.sent) if isinstance(msg, m.Ack))
    said = [
        (i, msg.values)
        for i, msg in enumerate(link.sent)
        if isinstance(msg, m.Metrics) and "group/min_workers" in msg.values
    ]
    assert [values for _, values in said] == [
        {"group/min_workers": 4.0, "group/drafters": 2.0},
        {"group/min_workers": 4.0, "group/drafters": 3.0},
    ]  # said at each new count, not at every vote
    assert all(i < first_ack for i, _ in said)
    acks = [msg for msg in link.sent if isinstance(msg, m.Ack)]
    assert [(a.batch_ids, a.step) for a in acks] == [([0], 1), ([1], 2), ([2], 3)]  # none lost, in order
    assert result.steps == 3 and result.stop_reason == "all epochs trained"
    assert s.ledger.complete(0)
    err = capsys.readouterr().err
    assert err.count("waiting for 4 workers (2 in) before the first step (--min-workers 4)") == 1, err
    assert "(3 in)" not in err  # the log says it once


def test_the_default_steps_at_once(tmp_path: Path):
    link = Link([_batch(0)])
    group = ScriptedGroup([1], link)
    s = _session(link, group, samples=1, train=TrainConfig(eval_generate="off"), run_dir=tmp_path)
    run_training(s, lambda: False)
    assert [(a.batch_ids, a.step) for a in link.sent if isinstance(a, m.Ack)] == [([0], 1)]
    assert not any(isinstance(x, m.Metrics) and "group/min_workers" in x.values for x in link.sent)
