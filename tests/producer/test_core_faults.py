"""What the producer's core says about a worker's resource faults: a full disk stops the run with the
worker's one line (every checkpoint would fail alike), a disk nearly full is warned about once per report,
and a preemption warning asks the workers for a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_pipe.producer.errors import RunAborted
from dflash_pipe.wire import messages as m
from tests.producer.test_core import _core, _hello


def test_a_full_disk_on_a_worker_stops_the_run_with_its_line(tmp_path: Path) -> None:
    core, out, _ = _core(tmp_path)
    core.handle(b"a", _hello("w0"))
    line = f"{tmp_path}/checkpoints: no space left for checkpoint step-00000010 (needs 7.7 MiB, 1.0 MiB free ...)"
    with pytest.raises(RunAborted) as info:
        core.handle(b"a", m.Error(source="w0", message=f"DiskFullError: {line}", traceback=""))
    assert str(info.value) == f"worker w0: {line}"


def test_a_nearly_full_disk_is_warned_about(tmp_path: Path) -> None:
    core, _, metrics = _core(tmp_path)
    said: list[str] = []
    core.account.warn = said.append
    core.handle(b"a", _hello("w0"))
    values = {"disk/free_bytes": 3.0 * 2**20, "disk/checkpoint_bytes": 2.0 * 2**20, "disk/low_space": 1.0}
    core.handle(b"a", m.Metrics(step=5, values=values))
    assert len(said) == 1 and "3.0 MiB free, a checkpoint takes 2.0 MiB: the next one may not fit" in said[0]
    assert any("disk/low_space" in record for record, _ in metrics.records)


def test_a_preemption_warning_asks_every_worker_for_a_checkpoint(tmp_path: Path) -> None:
    core, out, _ = _core(tmp_path)
    said: list[str] = []
    core.account.warn = said.append
    core.request_checkpoint("SIGUSR1 (preemption warning)")
    assert said == [
        "SIGUSR1 (preemption warning): no worker has joined yet, so there is nothing to checkpoint"
    ]
    core.handle(b"a", _hello("w0"))
    core.handle(b"b", _hello("w1"))
    core.request_checkpoint("SIGUSR1 (preemption warning)")  # joined, nothing trained yet
    assert said[-1] == (
        "SIGUSR1 (preemption warning): nothing is trained yet (step 0), so there is nothing to checkpoint; "
        "training goes on"
    )
    assert [len(out.of(peer, m.Checkpoint)) for peer in (b"a", b"b")] == [0, 0]
    core.account.step = 4  # the group's step, as the workers' metrics report it
    core.request_checkpoint("SIGUSR1 (preemption warning)")
    assert said[-1] == "SIGUSR1 (preemption warning): checkpoint asked at step 4; training goes on"
    assert [len(out.of(peer, m.Checkpoint)) for peer in (b"a", b"b")] == [1, 1]
    core.handle(b"a", m.Checkpoint(step=4, path=str(tmp_path / "checkpoints" / "step-00000004")))
    assert said[-1].startswith("checkpoint written at step 4 (SIGUSR1 (preemption warning))")
    assert core.account.last_checkpoint_at is not None


def test_a_second_worker_with_a_taken_name_is_refused_naming_both(tmp_path: Path) -> None:
    core, out, _ = _core(tmp_path)
    core.handle(b"a", _hello("w0"))
    core.handle(b"b", m.Hello(worker_name="w0", host="other", pid=7, device="cpu", capabilities=["frames"]))
    assert b"b" not in core.peers
    [(who, reason)] = out.rejected
    assert who == b"b" and "a worker named 'w0' is already in this run (cpu on h, pid 1)" in reason
    assert "another --name" in reason
    core.handle(b"c", _hello("w1"))  # another name is welcome
    assert out.of(b"c", m.Welcome)


def test_the_same_process_reconnecting_takes_its_name_back(tmp_path: Path) -> None:
    core, out, _ = _core(tmp_path)
    core.handle(b"a", _hello("w0"))
    core.handle(b"a2", _hello("w0"))  # same host and pid: its old connection is gone
    assert core.peers[b"a"].left and out.of(b"a2", m.Welcome) and out.rejected == []
