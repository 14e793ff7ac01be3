"""launch/slurm.sbatch as Slurm drives it, on the CPU demo: the warning signal (`--signal=B:USR1@120`)
checkpoints the run and requeues the job; the requeue's SIGTERM drains it; the requeued job resumes by
itself. `scontrol` is a stand-in that records the requeue and signals the job as Slurm would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_pipe.run.checkpoint import latest_checkpoint, read_trainer_state
from tests.launch_flags import SMALL_RUN, demo_subset

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "launch" / "slurm.sbatch"

FAKE_SCONTROL = """#!/usr/bin/env bash
# Slurm's requeue of a running job: SIGTERM to every process of the batch step, then it runs again later.
echo "$@" >> "$SCONTROL_LOG"
if [ "$1" = requeue ]; then
    trap '' TERM
    kill -TERM -- "-$(ps -o pgid= "$PPID" | tr -d ' ')"
fi
"""


def test_the_warning_signal_checkpoints_requeues_and_the_requeued_job_resumes(tmp_path: Path):
    """About a minute: a live launch under a fake scontrol gets Slurm's warning signal, requeues and resumes.
    The recipe's run at SMALL_RUN's sizes on 200 demo conversations, epochs enough that it is still training
    when the signal comes (the signals and the script are the same at any size)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    run_dir, log = tmp_path / "run", tmp_path / "scontrol.log"
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("TARGET_MODEL", "DATA")},
        "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]]),
        "PYTHONPATH": str(ROOT),
        "RUN_DIR": str(run_dir),
        "RECIPE": str(ROOT / "launch" / "cpu-demo.yaml"),
        "SLURM_JOB_ID": "4242",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SCONTROL_LOG": str(log),
    }
    data = demo_subset(tmp_path / "demo200.jsonl", 200)
    first = subprocess.Popen(
        ["bash", str(SBATCH), "--max-steps", "100000", "--checkpoint-every", "100000", "--responses",
         "dataset", "--eval-generate", "off", *SMALL_RUN, "--data", str(data), "--epochs", "100"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # the job's process group, which the stand-in scontrol signals
    )  # fmt: skip
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().count('"loss"') >= 2):
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
            time.sleep(0.5)
        os.kill(first.pid, signal.SIGUSR1)  # what --signal=B:USR1@120 sends to the batch shell
        out, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 0, out
    assert log.read_text().split("\n")[0] == "requeue 4242", out
    assert "checkpoint written at step" in out and "stopped by SIGTERM: final checkpoint" in out, out
    assert "stopped at once" not in out, out  # Slurm's SIGTERM and the script's forwarded one are one request
    step = read_trainer_state(latest_checkpoint(run_dir)).step
    assert step >= 1

    again = subprocess.run(  # the requeued job: the same script, no other change
        ["bash", str(SBATCH), "--max-steps", str(step + 2)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resuming from step-{step:08d}" in again.stdout + again.stderr
    assert read_trainer_state(latest_checkpoint(run_dir)).step == step + 2
