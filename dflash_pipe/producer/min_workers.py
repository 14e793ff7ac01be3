"""What the producer says while the drafters wait for ``train.min_workers`` before the first step.

The workers decide when to start (``StepVote.may_step``); rank 0 reports the group's size each time it
changes while it waits (``group/min_workers``, ``group/drafters`` METRICS). The producer shows that on its
dashboard and log, says when the first step came, and, on the run's coordinator, stops the run with a line
naming ``--min-workers`` when the count is still short after ``wire.join_timeout_s``: a node that never
comes must not leave a cluster idle without a word.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from dflash_pipe.producer.errors import RunAborted

if TYPE_CHECKING:
    from dflash_pipe.producer.parts import CoreParts


def waiting_line(needed: int, present: int) -> str:
    return (
        f"waiting for {needed} workers ({present} in) before the first step (--min-workers {needed}); attach "
        "the others with `dflash-pipe producer --connect` or `dflash-pipe worker --connect`"
    )


def heard_waiting(core: CoreParts, values: dict[str, Any]) -> None:
    """Rank 0's report of a waiting group (a METRICS with ``group/min_workers``)."""
    needed, present = int(values["group/min_workers"]), int(values.get("group/drafters", 0))
    core.peers.heard_waiting(needed, present)
    core.note(waiting_line(needed, present))


def watch_group_wait(core: CoreParts, *, coordinator: bool, now: float | None = None) -> None:
    """Once the first step is acknowledged, says so and forgets the wait. On the coordinator, a wait past
    ``wire.join_timeout_s`` raises ``RunAborted`` naming ``--min-workers``; attached producers only show it
    (the coordinator decides for the run)."""
    wait = core.peers.group_wait
    if wait is None:
        return
    if core.account.first_ack is not None:
        core.note(f"the group holds {wait.needed} or more workers: training started")
        core.peers.wait_ended()
        return
    waited = (time.monotonic() if now is None else now) - wait.since
    limit = core.cfg.wire.join_timeout_s
    if coordinator and waited > limit:
        raise RunAborted(
            f"--min-workers {wait.needed}: only {wait.present} worker(s) joined the drafters' group within "
            f"{limit:.0f} s (wire.join_timeout_s), so no step was taken. Start the missing nodes' producers "
            "(`dflash-pipe producer --connect`) or workers, or resume with fewer: `dflash-pipe launch --resume "
            f"RUN_DIR --min-workers {max(wait.present, 1)}`; to wait longer, set wire.join_timeout_s in a "
            "--config file."
        )
