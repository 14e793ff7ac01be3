"""A worker welcomed while the held-out set was still being regenerated: its eval BATCHes arrive during
training, are never trained on, and are used only once all of them came; an evaluation due before says
so instead of reporting a tau."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import torch

from dflash_pipe.config.train import TrainConfig
from dflash_pipe.train.real_eval import RealEval
from dflash_pipe.wire import messages as m
from dflash_pipe.worker.loop import _collect, evaluate

HIDDEN = 8


def _eval_batch(batch_id: int, of: int) -> m.Batch:
    lengths = [5, 3]
    return m.Batch(
        batch_id=batch_id,
        epoch=0,
        sample_ids=[10 + 2 * batch_id, 11 + 2 * batch_id],
        lengths=lengths,
        tensors={
            "input_ids": torch.arange(8),
            "loss_mask": torch.tensor([0, 0, 1, 1, 1, 0, 1, 1], dtype=torch.uint8),  # prompt, reply
            "features": torch.randn(8, HIDDEN),
            "target_next": torch.arange(1, 9),
        },
        for_eval=True,
        eval_set=of,
    )


class Link:
    def __init__(self, messages: list) -> None:
        self.messages = deque(messages)

    def get(self, timeout_s: float):
        return self.messages.popleft() if self.messages else None


def _session(messages: list, eval_generate: str = "off") -> SimpleNamespace:
    return SimpleNamespace(
        link=Link(messages),
        device=torch.device("cpu"),
        feature_size=HIDDEN,
        train=TrainConfig(eval_generate=eval_generate),
        eval_batches=[],
        eval_incoming=[],
        eval_pending=True,
        real_eval=None,
        target_path="/models/target",
    )


def test_a_late_eval_set_is_taken_whole_and_never_trained():
    train = m.Batch(batch_id=3, epoch=0, sample_ids=[0], lengths=[4], tensors={"input_ids": torch.arange(4)})
    s = _session([_eval_batch(0, of=2), train])
    pending: deque = deque()
    _collect(s, pending, wait_s=0.0)
    assert list(pending) == [train]  # the eval BATCH is not a training batch
    assert s.eval_batches == [] and len(s.eval_incoming) == 1 and s.eval_pending  # half a set: not used
    assert evaluate(s) == {"eval/skipped": 1.0}
    s.link.messages.append(_eval_batch(1, of=2))
    _collect(s, pending, wait_s=0.0)
    assert len(s.eval_batches) == 2 and s.eval_incoming == [] and not s.eval_pending
    assert s.eval_batches[1].input_ids.shape == (2, 5)  # unpacked: one padded row per sample
    assert s.real_eval is None  # train.eval_generate off


def test_a_late_eval_set_gets_its_real_evaluation():
    s = _session([_eval_batch(0, of=1)], eval_generate="end")
    _collect(s, deque(), wait_s=0.0)
    assert isinstance(s.real_eval, RealEval) and str(s.real_eval.target_path) == "/models/target"
    assert s.real_eval.prompts and s.real_eval.due(final=True) and not s.real_eval.due(final=False)


def test_no_eval_set_at_all_reports_nothing():
    s = _session([])
    s.eval_pending = False  # the run has no held-out samples: nothing to say at each evaluation
    assert evaluate(s) == {}
