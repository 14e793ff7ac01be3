"""``train.min_workers``: the group takes no step before it holds that many drafters, and once started never
waits again. The decision reads only the step vote, which every rank shares."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dflash_pipe.config.train import TrainConfig
from dflash_pipe.train.distributed import DrafterGroup, StepVote


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


@pytest.mark.slow  # two rendezvous rounds in this process, the second after the first member's keep-alive expires
def test_a_member_that_comes_after_the_start_never_waits_again():
    """The started flag outlives every member that saw it: the run's store keeps it for the next ones (a node
    lost after the start must not send the group back to waiting). A new store (a new launch) starts over."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def member() -> DrafterGroup:
        group = DrafterGroup(
            f"tcp://127.0.0.1:{store.port}",
            run_id="t",
            device=torch.device("cpu"),
            timeout_s=30,
            join_timeout_s=60,
        )
        group.form()
        return group

    first = member()
    try:
        vote = first.vote(has_batch=True, stop=False, leave=False, num_ids=1)
        assert (vote.drafters, vote.started, vote.may_step(4)) == (1, False, False)
        first.mark_started()
    finally:
        first.close()
    later = member()  # alone in the next round, once the first one's keep-alive has expired
    try:
        vote = later.vote(has_batch=True, stop=False, leave=False, num_ids=1)
        assert (vote.drafters, vote.started, vote.may_step(4)) == (1, True, True)
    finally:
        later.close()
