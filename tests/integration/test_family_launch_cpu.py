"""`dflash-pipe launch` end to end on targets other than the demo's Qwen3: a hybrid (Qwen3.5, Gated DeltaNet
+ gated attention) and an MoE with latent attention (DeepSeek-V3), 3 steps each on CPU, at SMALL_RUN's sizes on
200 demo conversations; the final evaluation's real decoding runs on each target's cache, 32 tokens a prompt
(at the default 256 it took a minute of the DeepSeek-V3 launch's 70 s). (What a launch refuses before any work
starts: tests/cli/test_launch_refusals.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_pipe.run.checkpoint import latest_checkpoint, read_trainer_state
from tests.launch_flags import SMALL_RUN, demo_subset
from tests.target.families import FAMILIES

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SMALL = [*SMALL_RUN, "--eval-samples", "4", "--eval-max-new-tokens", "32"]


def launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dflash_pipe", "launch", "--plain", "--device", "cpu", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("row", ["qwen3_5-text", "deepseek_v3"])
def test_three_steps_train_and_the_run_exits_cleanly(row: str, tmp_path: Path):
    """The deepseek_v3 launch used to train, print its summary and then abort (SIGABRT: a target thread was
    still inside the forward at interpreter exit); the exit code and the output say it no longer does."""
    target = FAMILIES[row].save_target(tmp_path / "target")
    run_dir, data = tmp_path / "run", demo_subset(tmp_path / "demo200.jsonl", 200)
    out = launch(
        "--target-model", str(target), "--data", str(data), "--workers", "1", "--max-steps", "3",
        "--run-dir", str(run_dir), *SMALL,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "stopped: reached max_steps=3" in text, text
    assert "terminate called" not in text and "Aborted" not in text and "Traceback" not in text, text
    state = read_trainer_state(latest_checkpoint(run_dir))
    assert state.step == 3
