"""``train.min_workers``: the group takes no step before it holds that many drafters, and once started never
waits again. The decision reads only the step vote, which every rank shares."""

from __future__ import annotations

import pytest

from dflash_pipe.train.config import TrainConfig
from dflash_pipe.train.distributed import StepVote


def _vote(drafters: int, *, started: bool = False) -> StepVote:
    return StepVote(
        active=drafters,
        stop=False,
        counts=[1] * drafters,
        leaving=[False] * drafters,
        waiting=0,
        drafters=drafters,
        started=started,
    )


@pytest.mark.parametrize(
    ("drafters", "started", "min_workers", "may"),
    [
        (1, False, 1, True),  # the default: whoever is in trains
        (2, False, 4, False),  # a partial cluster waits
        (3, False, 4, False),
        (4, False, 4, True),  # the whole cluster is in
        (5, False, 4, True),
        (2, True, 4, True),  # started: a lost node never stops the run again
        (1, True, 8, True),
    ],
)
def test_the_gate_opens_at_min_workers_and_stays_open(
    drafters: int, started: bool, min_workers: int, may: bool
):
    assert _vote(drafters, started=started).may_step(min_workers) is may


def test_min_workers_is_checked_and_travels_in_the_welcome_config():
    assert TrainConfig().min_workers == 1
    assert TrainConfig.from_dict(TrainConfig(min_workers=4).to_dict()).min_workers == 4
    with pytest.raises(ValueError, match=r"--min-workers\) must be >= 1, got 0"):
        TrainConfig(min_workers=0)
