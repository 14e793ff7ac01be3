import math

import pytest

from dflash_pipe.config.train import TrainConfig
from dflash_pipe.train.optim import lr_at, schedule_progress


def test_warmup_then_cosine_to_the_floor():
    cfg = TrainConfig(lr=1.0, warmup_ratio=0.1, min_lr_ratio=0.1)
    assert lr_at(0.05, cfg) == pytest.approx(0.5)
    assert lr_at(0.1, cfg) == pytest.approx(1.0)
    assert lr_at(0.55, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(1.0, cfg) == pytest.approx(0.1)
    assert lr_at(2.0, cfg) == pytest.approx(0.1)
    assert lr_at(0.0, cfg) > 0  # the first step still moves


@pytest.mark.parametrize(
    ("field", "value"),
    [("lr", 0), ("warmup_ratio", 1.0), ("epochs", 0), ("grad_clip", -1), ("compile", "yes")],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"train.{field}"):
        TrainConfig(**{field: value})


def test_a_max_steps_run_warms_up_over_its_steps_and_decays_to_its_end():
    """200 steps of a plan of 6 epochs that they never finish: the epoch plan alone would still be warming
    up at the end (half the peak); following the steps, the peak comes at 4% and the rate decays to the floor."""
    cfg = TrainConfig(lr=6e-4, max_steps=200)
    per_step = 1 / (200 * 50)  # the samples of a step, as a share of the planned ones
    rates = [lr_at(schedule_progress(step * per_step, step, cfg), cfg) for step in range(200)]
    peak = max(rates)
    assert peak == pytest.approx(6e-4, rel=1e-3)
    assert rates.index(peak) == 8  # 4% of 200 steps
    assert all(a <= b for a, b in zip(rates[:8], rates[1:9], strict=True))
    assert all(a >= b for a, b in zip(rates[8:], rates[9:], strict=False))
    assert rates[-1] < 0.001 * peak
    assert lr_at(200 * per_step, cfg) == pytest.approx(0.5 * peak)  # the epoch plan alone, at the end


def test_without_max_steps_or_when_the_epochs_end_first_samples_drive_the_schedule():
    assert schedule_progress(0.3, 10, TrainConfig()) == 0.3
    assert schedule_progress(0.9, 10, TrainConfig(max_steps=1000)) == 0.9
