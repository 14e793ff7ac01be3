"""The producer while the drafters wait for ``--min-workers``: the dashboard says for how many, the first
step is announced, and a count still short after the join timeout stops the run with a line naming
``--min-workers`` (on the coordinator only: an attached producer just shows it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dflash_pipe.producer.accounting import Accounting
from dflash_pipe.producer.errors import RunAborted
from dflash_pipe.producer.min_workers import heard_waiting, watch_group_wait
from dflash_pipe.producer.peers import Peers


def _core(join_timeout_s: float = 600.0) -> SimpleNamespace:
    """The parts of a core these steps use: its real peers and accounting, a config with one field."""
    account = Accounting(metrics=SimpleNamespace(log=lambda *_: None), step=0)
    return SimpleNamespace(
        peers=Peers(),
        account=account,
        note=account.note,
        cfg=SimpleNamespace(wire=SimpleNamespace(join_timeout_s=join_timeout_s)),
    )


def test_the_dashboard_says_what_the_run_waits_for_and_when_it_starts():
    core = _core()
    heard_waiting(core, {"group/min_workers": 4.0, "group/drafters": 2.0})
    heard_waiting(core, {"group/min_workers": 4.0, "group/drafters": 3.0})
    assert core.account.messages[0].startswith(
        "waiting for 4 workers (2 in) before the first step (--min-workers 4)"
    )
    assert core.account.messages[1].startswith("waiting for 4 workers (3 in)")
    since = core.peers.group_wait.since
    watch_group_wait(core, coordinator=True, now=since + 10)
    assert core.peers.group_wait is not None  # still waiting, well within the join timeout
    core.account.first_ack = (since + 11, 0)
    watch_group_wait(core, coordinator=True, now=since + 12)
    assert core.peers.group_wait is None and core.account.messages[-1].endswith("training started")


def test_a_count_never_reached_stops_the_run_naming_min_workers():
    core = _core(join_timeout_s=60)
    heard_waiting(core, {"group/min_workers": 8.0, "group/drafters": 6.0})
    since = core.peers.group_wait.since
    watch_group_wait(core, coordinator=False, now=since + 3600)  # an attached producer only shows it
    with pytest.raises(RunAborted, match=r"--min-workers 8: only 6 worker\(s\) joined .* within 60 s") as err:
        watch_group_wait(core, coordinator=True, now=since + 61)
    assert "--resume RUN_DIR --min-workers 6" in str(err.value)


def test_no_report_no_wait():
    core = _core(join_timeout_s=0)
    watch_group_wait(core, coordinator=True, now=1e9)
    assert core.account.messages == []
