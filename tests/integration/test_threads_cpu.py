"""End to end on CPU: `launch --drafter-mode threads` trains the demo with two drafter threads in one worker."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_pipe.run.checkpoint import latest_checkpoint, read_trainer_state
from dflash_pipe.run.ledger import Ledger
from tests.launch_flags import SMALL_RUN, demo_subset

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_launch_with_drafter_threads(tmp_path: Path):
    """At SMALL_RUN's sizes on 200 demo conversations: the threads, the group of one and the ledger are the
    same at any size."""
    run_dir, data = tmp_path / "run", demo_subset(tmp_path / "demo200.jsonl", 200)
    cmd = [sys.executable, "-m", "dflash_pipe", "launch", "--plain", "--run-dir", str(run_dir)]
    cmd += ["--device", "cpu", "--workers", "2", "--drafter-mode", "threads", "--max-steps", "8"]
    cmd += [*SMALL_RUN, "--data", str(data), "--activation-checkpointing", "layers"]
    cmd += ["--responses", "dataset", "--eval-generate", "off"]  # the threads' feature path only
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    logs = sorted(p.name for p in (run_dir / "logs").iterdir())
    assert logs == ["worker0.log"]  # one worker process for both drafters
    state = read_trainer_state(latest_checkpoint(run_dir))
    assert state.step == 8 and state.extra["world_size"] == 1
    ledger = Ledger.from_dict(state.ledger)
    assert ledger.duplicates == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses and all(math.isfinite(loss) for loss in losses), losses  # logged, no NaN or inf
    assert "2 drafter threads on cpu, cpu" in (run_dir / "logs" / "worker0.log").read_text()
