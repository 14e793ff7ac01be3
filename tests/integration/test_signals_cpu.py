"""Signals as a cluster sends them, on a live CPU run: SIGTERM drains `launch` to a checkpoint and a clean
exit (no process left, the run dir released, a run that resumes), USR1 checkpoints and trains on, and a
worker still connecting leaves at once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_pipe.run.checkpoint import latest_checkpoint, read_trainer_state
from tests.integration.test_faults_cpu import ROOT, LiveRun, worker_pid
from tests.launch_flags import demo_subset

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_sigterm_drains_the_launch_usr1_checkpoints_and_the_run_resumes(tmp_path: Path):
    """About 35 s: a live launch takes SIGUSR1 (checkpoint, train on) and SIGTERM (drain), then resumes: the
    signals are only proven on real processes."""
    run_dir = tmp_path / "run"
    data = demo_subset(tmp_path / "data.jsonl", 200)
    args = ["--data", str(data), "--epochs", "100", "--max-steps", "100000", "--checkpoint-every", "100000"]
    run = LiveRun(run_dir, *args, "--stop-timeout", "60")
    address = run.wait_for(r"producer at (tcp://\S+?),").group(1)
    run.wait_for_steps()
    pids = [worker_pid(address, f"worker{i}") for i in range(2)]

    run.proc.send_signal(signal.SIGUSR1)  # a preemption warning: a checkpoint now, and training goes on
    step = int(run.wait_for(r"checkpoint written at step (\d+)", timeout=60).group(1))
    assert read_trainer_state(latest_checkpoint(run_dir)).step == step
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while max(json.loads(line).get("step", 0) for line in metrics.read_text().splitlines()) <= step + 1:
        assert run.proc.poll() is None and time.monotonic() < deadline, "".join(run.lines)
        time.sleep(0.3)

    started = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)  # what Kubernetes, systemd, docker stop and `timeout` send
    rc, out = run.finish(timeout=90)
    assert rc == 0, out
    assert time.monotonic() - started < 60, out
    assert "SIGTERM: draining" in out and "stopped by SIGTERM: final checkpoint" in out, out
    final = read_trainer_state(latest_checkpoint(run_dir)).step
    assert final > step + 1
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "a worker outlived the drained launch"
        time.sleep(0.2)
    assert json.loads((run_dir / "owner.json").read_text()).get("released")

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    resumed = subprocess.run(
        [sys.executable, "-m", "dflash_pipe", "launch", "--resume", str(run_dir), "--plain",
         "--max-steps", str(final + 2)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming from step-{final:08d}" in resumed.stderr
    assert read_trainer_state(latest_checkpoint(run_dir)).step == final + 2


def test_a_worker_still_connecting_leaves_at_once_on_sigterm():
    with socket.socket() as s:  # a port nobody listens on: the worker waits for a WELCOME that never comes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_pipe", "worker", "--connect", f"tcp://127.0.0.1:{port}",
         "--device", "cpu", "--name", "lonely", "--join-timeout", "600"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stderr.readline()
        assert "lonely: connecting to" in line, line
        time.sleep(1.0)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=20)
        err = line + proc.stderr.read()
        assert rc == 0, err
        assert "stopped by SIGTERM before training" in err, err
        assert time.monotonic() - started < 10
    finally:
        if proc.poll() is None:
            proc.kill()
