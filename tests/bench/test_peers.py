"""The peers' wall-clock budget (dflash_pipe/bench/peer_common.py) driving SpecForge's trainer
(``peers.SpecForgeControl``): marks, stops, the fitted horizon."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from dflash_pipe.bench.peer_common import TimeBudget, budget_marks
from dflash_pipe.bench.peers import SpecForgeControl, set_cosine_horizon


class FakeTrainer:
    def __init__(self):
        self.last_checkpoint_step = None
        self._controller = SimpleNamespace(max_steps=None)
        self.saved = []

    def save_checkpoint(self):
        self.last_checkpoint_step = len(self.saved) + 1
        self.saved.append(self.last_checkpoint_step)
        return SimpleNamespace(checkpoint_uri=f"file:///ckpt-{self.last_checkpoint_step}")


def test_budget_marks_default_to_a_quarter_and_a_half():
    assert budget_marks(8, None) == [120.0, 240.0]
    assert budget_marks(8, [2, 4, 8, 9]) == [120.0, 240.0]  # the end is saved anyway


def test_budget_saves_passed_marks_once_and_stops_at_the_deadline(tmp_path):
    trainer = FakeTrainer()
    budget = TimeBudget(
        start=time.perf_counter() - 50,
        deadline=100,
        marks=[10.0, 40.0, 70.0],
        metrics_path=tmp_path / "m.jsonl",
        warmup_ratio=0.04,
        fit_horizon=False,
        trainer=SpecForgeControl(trainer),
    )
    budget({"loss": torch.tensor(2.0), "acc": 0.5}, 1)
    assert len(budget.saved) == 1 and budget.marks == [70.0]  # two marks passed, one save for the step
    assert trainer._controller.max_steps is None
    budget.start -= 60
    budget({"loss": 1.0}, 2)
    assert [s["step"] for s in budget.saved] == [1, 2]
    assert trainer._controller.max_steps == 2 and budget.stopped_by == "time"
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["loss"] == 2.0


def test_fitted_horizon_follows_specforges_own_schedule_from_the_fit_on():
    """Re-aimed during its warm-up, SpecForge's scheduler gives from then on exactly the LRs it gives when
    built for that horizon (its own blip after the warm-up included), down to zero at the horizon."""
    lr_scheduler = pytest.importorskip("specforge.lr_scheduler")

    def lrs(total, warmup, fit_at=None):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        sched = lr_scheduler.CosineAnnealingWarmupLR(opt, total_steps=total, warmup_steps=warmup)
        out = []
        for i in range(20):
            if i == fit_at:
                set_cosine_horizon(SimpleNamespace(scheduler=sched), horizon=20, warmup=5)
            opt.step()
            sched.step()
            out.append(opt.param_groups[0]["lr"])
        return out

    native, fitted = lrs(20, 5), lrs(1_000_000, 40_000, fit_at=3)
    assert fitted[:3] == pytest.approx([1e-3 * k / 40_000 for k in (2, 3, 4)])
    assert fitted[3:] == pytest.approx(native[3:], rel=1e-9, abs=1e-15)
    assert fitted[-1] == pytest.approx(0.0, abs=1e-12)
