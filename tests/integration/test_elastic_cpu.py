"""Elastic drafter group on CPU: a worker attaches mid-run, a worker is SIGKILLed, the producer is SIGKILLed
and resumed. Each run trains one epoch (the attach, two) of a small data set, and its ledger proves no sample
was lost.

Each test prints the figures docs/reliability.md records (run with ``-s`` to see them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_faults_cpu import ROOT, LiveRun, worker_pid

from dflash_pipe.run.checkpoint import latest_checkpoint, read_trainer_state
from dflash_pipe.run.ledger import Ledger
from tests.launch_flags import demo_subset

pytestmark = pytest.mark.slow

SAMPLES = 240
"""An epoch of the first 240 demo conversations (236 trained, 4 held out) at the sizes LiveRun launches with
(tests/launch_flags.py): ~60 batches, 26 steps of two workers, ~6 s of training on 2 idle cores, so a fault
at step 1 or 10 leaves steps to train after it."""
ATTACH_EPOCHS = 100
"""More than the attach test ever trains: it stops the run with Ctrl-C once an epoch was trained whole by
the group of two, whenever the newcomer got in."""
TWO_FAULTS_EPOCHS = 3
"""Three epochs of ``SAMPLES`` for two faults in turn, each waited out before the next: ~60 steps of two or
three workers, so steps are left after the second even when a loaded machine slows the regroups."""


class ResumedRun(LiveRun):
    """``launch --resume RUN_DIR``: the saved config, no layout flags."""

    def __init__(self, run_dir: Path, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "dflash_pipe", "launch", "--plain", "--resume", str(run_dir), *args]
        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        self.lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for_row(run: LiveRun, test, timeout: float = 90, skip: int = 0) -> dict:
    """The first metrics row (after the first ``skip``) that passes ``test``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for row in rows(run.run_dir)[skip:]:
            if test(row):
                return row
        assert run.proc.poll() is None, "".join(run.lines)
        time.sleep(0.1)
    raise AssertionError("metrics never showed the expected row:\n" + "".join(run.lines))


def wait_for_a_whole_epoch(run: LiveRun, epochs: int, timeout: float = 240) -> int:
    """Waits until the epoch after the current one (the run's ``progress`` times its ``epochs``) is trained
    from start to end, and returns it: an epoch trained whole by the group as it is now."""
    whole = int(max((r["progress"] for r in rows(run.run_dir) if "progress" in r), default=0.0) * epochs) + 1
    wait_for_row(run, lambda r: r.get("progress", 0.0) * epochs > whole + 1.05, timeout=timeout)
    return whole


def final_ledger(run_dir: Path) -> tuple[int, Ledger]:
    state = read_trainer_state(latest_checkpoint(run_dir))
    return state.step, Ledger.from_dict(state.ledger)


def attach(address: str, name: str, log: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dflash_pipe", "worker", "--connect", address, "--device", "cpu"]
    cmd += ["--name", name, "--reconnect-timeout", "5", *extra]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in rows(run_dir) if "loss" in r]


def test_a_worker_attaches_mid_run_and_a_whole_epoch_trains_with_it(tmp_path: Path):
    """About a minute: a launch of one worker, a second attached once it trains. However long the
    newcomer's start-up takes on a loaded machine (a process importing torch, then the group's regroup: 22 s
    on 2 idle cores, more than a whole epoch of one worker's steps when the cores are busy), the run has
    epochs left (``ATTACH_EPOCHS``): the test waits for the group of two, then for an epoch trained whole by
    it, and stops the run with Ctrl-C (a drain). The steps after the join train two batches in about the
    time of one."""
    data = demo_subset(tmp_path / "data.jsonl", SAMPLES)
    args = ["--workers", "1", "--data", str(data), "--epochs", str(ATTACH_EPOCHS), "--eval-samples", "4"]
    run = LiveRun(tmp_path / "run", *args, "--checkpoint-every", "100000")
    address = run.wait_for(r"producer at (tcp://\S+?),").group(1)
    run.wait_for_steps()
    extra = attach(address, "attached", tmp_path / "attached.log")
    t0 = time.monotonic()
    try:
        joined = wait_for_row(run, lambda r: r.get("world_size") == 2 and "generation" in r, timeout=240)
        join_s = time.monotonic() - t0
        whole = wait_for_a_whole_epoch(run, ATTACH_EPOCHS)
        run.proc.send_signal(signal.SIGINT)
        rc, out = run.finish(timeout=120)
        assert rc == 0, out
        assert extra.wait(timeout=60) == 0, (tmp_path / "attached.log").read_text()
    finally:
        if extra.poll() is None:
            extra.kill()
    step, ledger = final_ledger(run.run_dir)
    counts = [ledger.count(e) for e in range(whole + 1)]
    assert all(ledger.complete(e) for e in range(whole + 1)) and ledger.duplicates == 0, (whole, counts)
    trained_after_join = [r for r in rows(run.run_dir) if "loss" in r and r["step"] > joined["step"]]
    assert trained_after_join and all(r["world_size"] == 2 for r in trained_after_join[:1])
    curve = losses(run.run_dir)
    assert curve[-1] < curve[0] and trained_after_join[-1]["loss"] < curve[0], curve
    assert any("time_to_first_step_s/attached" in r for r in rows(run.run_dir))
    print(
        f"\nFIGURES attach: world 1 -> 2 at step {joined['step']}, {join_s:.1f} s from `worker` start to the "
        f"new group (regroup {joined['regroup_s']:.1f} s), epoch {whole} trained whole by the two, steps {step}, "
        f"samples per epoch {counts} of {ledger.num_samples}, duplicates {ledger.duplicates}, loss "
        f"{curve[0]:.2f} -> {curve[-1]:.2f}"
    )


def test_a_worker_leaves_on_ctrl_c_then_one_is_sigkilled_and_the_last_finishes_the_epochs(tmp_path: Path):
    """About 40 s: one live launch of three workers meets both ways of losing a worker in turn (a launch's
    start-up is most of such a test, so one launch serves both). worker2 is interrupted (Ctrl-C) and leaves
    cleanly: the group of two trains on, with no warning and no sample trained twice. Then worker1 is
    SIGKILLed: it is removed with a warning, and worker0 finishes the epochs without it, no sample lost."""
    data = demo_subset(tmp_path / "data.jsonl", SAMPLES)
    args = ["--workers", "3", "--data", str(data), "--epochs", str(TWO_FAULTS_EPOCHS), "--eval-samples", "4"]
    run = LiveRun(tmp_path / "run", *args)
    address = run.wait_for(r"producer at (tcp://\S+?),").group(1)
    wait_for_row(run, lambda r: r.get("world_size") == 3 and "loss" in r)
    os.kill(worker_pid(address, "worker2"), signal.SIGINT)
    t0 = time.monotonic()
    left = wait_for_row(run, lambda r: r.get("world_size") == 2 and "generation" in r)
    leave_s = time.monotonic() - t0
    after_leave = wait_for_row(
        run, lambda r: r.get("world_size") == 2 and "loss" in r and r["step"] > left["step"]
    )
    assert after_leave["duplicates"] == 0, after_leave  # the clean leave gave nothing to train twice
    before = len(rows(run.run_dir))
    os.kill(worker_pid(address, "worker1"), signal.SIGKILL)
    t0 = time.monotonic()
    regrouped = wait_for_row(run, lambda r: r.get("world_size") == 1 and "generation" in r, skip=before)
    recover_s = time.monotonic() - t0
    rc, out = run.finish(timeout=120)
    assert rc == 0, out
    assert "warning: worker worker2" not in out, out  # a clean leave is no fault
    assert "warning" in out and "worker1" in out, out
    step, ledger = final_ledger(run.run_dir)
    released = max(r.get("released_samples", 0) for r in rows(run.run_dir))
    counts = [ledger.count(e) for e in range(TWO_FAULTS_EPOCHS)]
    assert all(ledger.complete(e) for e in range(TWO_FAULTS_EPOCHS)), counts
    assert ledger.duplicates <= released, (ledger.duplicates, released)
    print(
        f"\nFIGURES worker Ctrl-C: group of 2 again {leave_s:.1f} s after SIGINT, duplicates 0; worker SIGKILL: "
        f"group re-formed {recover_s:.1f} s after the kill (regroup {regrouped['regroup_s']:.1f} s), steps {step}, "
        f"samples lost {TWO_FAULTS_EPOCHS * ledger.num_samples - ledger.total_trained()}, duplicates "
        f"{ledger.duplicates} (leased to it: {released} samples)"
    )


def test_a_sigkilled_producer_resumes_and_its_workers_reconnect(tmp_path: Path):
    """About 35 s (two launches' start-up): a live launch trains 10 steps, its producer is SIGKILLed, its
    workers wait to reconnect (alive, their logs saying how to resume), and a resume must find the same
    workers reconnecting."""
    data = demo_subset(tmp_path / "data.jsonl", SAMPLES)
    args = ["--data", str(data), "--epochs", "1", "--eval-samples", "4", "--checkpoint-every", "5"]
    run = LiveRun(tmp_path / "run", *args, "--peer-timeout", "5")
    address = run.wait_for(r"producer at (tcp://\S+?),").group(1)
    wait_for_row(run, lambda r: r.get("world_size") == 2 and "loss" in r and r["step"] >= 10)
    pids = [worker_pid(address, f"worker{i}") for i in range(2)]
    run.proc.kill()
    run.finish()
    t0 = time.monotonic()
    # the orphaned workers notice, say how to resume, and wait for a producer at the same address
    logs = [run.run_dir / "logs" / f"worker{i}.log" for i in range(2)]
    deadline = time.monotonic() + 40
    while not all("Reconnecting" in log.read_text() for log in logs):
        assert time.monotonic() < deadline, "workers did not notice their producer died"
        time.sleep(0.2)
    for log in logs:
        assert "--resume" in log.read_text(), log.read_text()
    assert all(Path(f"/proc/{pid}").exists() for pid in pids), "workers should wait for a resumed producer"
    saved_step, saved = final_ledger(run.run_dir)
    before = len(rows(run.run_dir))
    resumed = ResumedRun(run.run_dir, "--peer-timeout", "5")
    try:
        assert resumed.wait_for(r"producer at (tcp://\S+?),").group(1) == address
        resumed.wait_for("adopting")
        back = wait_for_row(resumed, lambda r: "generation" in r, skip=before)
        recover_s = time.monotonic() - t0
        rc, out = resumed.finish(timeout=120)
        assert rc == 0, out
    finally:
        for pid in pids:
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
    step, ledger = final_ledger(run.run_dir)
    assert step > saved_step and saved.trained(0) <= ledger.trained(0)
    assert ledger.complete(0) and ledger.duplicates == 0
    for i in range(2):
        log = (run.run_dir / "logs" / f"worker{i}.log").read_text()
        assert "Reconnecting" in log, log
    print(
        f"\nFIGURES producer SIGKILL: checkpoint at step {saved_step}, group of {back['world_size']} again at step "
        f"{back['step']} {recover_s:.1f} s after the kill (incl. the resumed launch's start-up), final step {step}, samples "
        f"lost {ledger.num_samples - ledger.count(0)}, duplicates {ledger.duplicates}"
    )


def test_a_worker_gives_up_with_a_message_when_no_producer_comes_back(tmp_path: Path):
    log = tmp_path / "w.log"
    proc = attach(
        "tcp://127.0.0.1:9", "lonely", log, "--join-timeout", "3"
    )  # nothing listens on the discard port
    assert proc.wait(timeout=60) != 0
    text = log.read_text()
    assert "no WELCOME" in text and "tcp://127.0.0.1:9" in text, text
