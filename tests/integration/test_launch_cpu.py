"""End to end on CPU: producer + 2 gloo workers on the demo target, checkpoint, then resume."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_pipe.run.checkpoint import latest_checkpoint, read_trainer_state
from dflash_pipe.run.ledger import Ledger
from dflash_pipe.target import default_cache_dir
from tests.launch_flags import LEARNING_RUN, demo_subset

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "dflash_pipe", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def launch(*args: str) -> subprocess.CompletedProcess:
    return cli("launch", "--plain", *args)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def untrained_export(exported: Path, out: Path) -> Path:
    """The export's drafter at a fresh initialisation (its config, its untrained weights), exported to ``out``."""
    import torch
    from torch import nn

    from dflash_pipe.drafter import export_drafter, load_exported

    config = json.loads((exported / "config.json").read_text())
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    drafter = load_exported(
        exported, embed_tokens=nn.Embedding(vocab, hidden), lm_head=nn.Linear(hidden, vocab, bias=False)
    )
    torch.manual_seed(0)
    drafter.reset_parameters()
    export_drafter(drafter, out)
    return out


def eval_tau(drafter: Path, data: Path) -> float:
    """The real tau `dflash-pipe eval` reports for ``drafter`` on the 8 prompts of ``data`` against the demo
    target. One thread: the demo target is tiny, and a second thread more than doubled the eval's CPU
    (20 s against 9 s on two shared cores) for no gain in time."""
    target = str(default_cache_dir())
    args = ["--target-model", target, "--drafter", str(drafter), "--data", str(data), "--max-samples", "8"]
    out = cli("eval", *args, "--device", "cpu", env={"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    return float(re.search(r"tau = ([0-9.]+)", out.stdout).group(1))


def test_two_workers_train_checkpoint_and_resume(tmp_path: Path):
    """About two minutes: two real launches (a producer regenerating with the demo target and two worker
    processes, 30 then 30 steps), an export and two evaluations: the path a user takes, end to end.

    Sized for two cores: the demo's 3-layer drafter with 8 blocks per sample in 512-token batches
    (LEARNING_RUN) learns enough in 60 steps for the tau claim below; 200 conversations (up to 5 epochs of
    them) bound the regeneration, which a launch runs over its whole data while the drafters train; the
    launch's own real eval decodes 4 prompts (it only has to run, lossless)."""
    run_dir = tmp_path / "run"
    data = demo_subset(tmp_path / "demo200.jsonl", 200)  # 184 to train, 16 held out (the tail)
    common = ["--device", "cpu", "--workers", "2", "--data", str(data), "--epochs", "5", *LEARNING_RUN]
    common += ["--eval-prompts", "4"]
    first = launch("--run-dir", str(run_dir), "--max-steps", "30", "--checkpoint-every", "10", *common)
    assert first.returncode == 0, first.stdout + first.stderr
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and ckpt.name == "step-00000030"
    state = read_trainer_state(ckpt)
    ledger = Ledger.from_dict(state.ledger)
    trained_first = ledger.trained(0)
    assert state.step == 30 and len(trained_first) > 0 and ledger.duplicates == 0
    assert state.extra["world_size"] == 2
    rows = [r for r in metrics(run_dir) if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]
    firsts = [r for r in metrics(run_dir) if any(k.startswith("time_to_first_step_s/") for k in r)]
    assert len(firsts) == 2
    assert any("simulated/tau" in r for r in metrics(run_dir))
    final = [r for r in metrics(run_dir) if "real/tau" in r]  # the real eval runs in the final evaluation
    assert len(final) == 1 and final[0]["step"] == 30 and final[0]["real/lossless_mismatches"] == 0
    assert final[0]["real/prompts"] >= 1  # real/tau itself is checked against an untrained drafter below
    counted = [r for r in metrics(run_dir) if "data/samples" in r]  # at the launch's start and its end
    assert [r["step"] for r in counted] == [0, 30] and counted[-1]["data/held_out"] == 16
    regenerated = counted[-1]["data/samples"] + counted[-1]["data/dropped"]  # so far: samples and voids
    assert 0 < regenerated <= 200 - 16 and counted[0]["data/samples"] == 0  # at the start: none yet
    assert "30 steps in" in first.stderr and "data: " in first.stderr and "samples dropped: " in first.stderr

    second = launch("--resume", str(run_dir), "--max-steps", "60")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming from step-00000030" in second.stderr
    assert "trained 30 steps this launch (step 30 -> 60)" in second.stderr, second.stderr
    state2 = read_trainer_state(latest_checkpoint(run_dir))
    assert state2.step == 60
    ledger2 = Ledger.from_dict(state2.ledger)
    assert trained_first < ledger2.trained(0) or ledger2.current_epoch() > 0
    assert ledger2.duplicates == 0
    # The trained drafter exports to the reference format and evaluates against the target.
    exported = tmp_path / "export"
    out = cli("export", str(run_dir), str(exported))
    assert out.returncode == 0, out.stderr
    assert (exported / "config.json").exists() and (exported / "model.safetensors").exists()
    untrained = untrained_export(exported, tmp_path / "untrained")
    held_out = tmp_path / "held_out.jsonl"  # 8 prompts of the held-out tail: never trained on
    held_out.write_text("\n".join(data.read_text().splitlines()[-8:]) + "\n")
    tau, tau_untrained = eval_tau(exported, held_out), eval_tau(untrained, held_out)
    # The 60 steps learnt what the target accepts: an untrained drafter gets nothing accepted (1.0). The
    # trained tau differs between runs of the same code (1.33, 1.34, 1.47, 1.49 on these prompts in four runs
    # on a loaded machine, 1.20-1.35 over four prompt sets after 40 steps; not pinned down: the order in which
    # regenerated replies reach the two workers is one candidate).
    assert tau > tau_untrained + 0.1, (tau_untrained, tau)
    steps = [r["step"] for r in metrics(run_dir) if "loss" in r]
    assert steps[-2:] == [50, 60]  # logged every 10 steps, continuing after 30
    assert [r["step"] for r in metrics(run_dir) if "simulated/tau" in r] == [30, 60]
    assert [r["step"] for r in metrics(run_dir) if "real/tau" in r] == [30, 60]


def test_fresh_launch_refuses_a_run_dir_with_checkpoints(tmp_path: Path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.json").write_text("{}")
    out = launch("--run-dir", str(run_dir), "--device", "cpu", "--max-steps", "1")
    assert out.returncode == 2
    assert "--resume" in out.stderr
