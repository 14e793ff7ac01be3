import math

import pytest

from dflash_pipe.train.config import TrainConfig
from dflash_pipe.train.optim import lr_at


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
