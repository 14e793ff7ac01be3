"""End to end on CPU: producer + 2 gloo workers on the demo target, checkpoint, then resume."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_pipe.data import demo_data_path
from dflash_pipe.run.checkpoint import latest_checkpoint, read_trainer_state
from dflash_pipe.run.ledger import Ledger
from dflash_pipe.target import default_cache_dir

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
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


def eval_tau(drafter: Path) -> float:
    """The real tau `dflash-pipe eval` reports for ``drafter`` on 8 demo prompts against the demo target."""
    target, data = str(default_cache_dir()), str(demo_data_path())
    args = ["--target-model", target, "--drafter", str(drafter), "--data", data, "--max-samples", "8"]
    out = cli("eval", *args, "--device", "cpu")
    assert out.returncode == 0, out.stderr
    return float(re.search(r"tau = ([0-9.]+)", out.stdout).group(1))


def test_two_workers_train_checkpoint_and_resume(tmp_path: Path):
    """Minutes: two real launches (a producer regenerating with the demo target and two worker processes,
    24 then 16 steps), an export and two evaluations: the path a user takes, end to end."""
    run_dir = tmp_path / "run"
    common = ["--device", "cpu", "--workers", "2", "--token-budget", "1024", "--max-length", "256"]
    first = launch("--run-dir", str(run_dir), "--max-steps", "24", "--checkpoint-every", "10", *common)
    assert first.returncode == 0, first.stdout + first.stderr
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and ckpt.name == "step-00000024"
    state = read_trainer_state(ckpt)
    ledger = Ledger.from_dict(state.ledger)
    trained_first = ledger.trained(0)
    assert state.step == 24 and len(trained_first) > 0 and ledger.duplicates == 0
    assert state.extra["world_size"] == 2
    rows = [r for r in metrics(run_dir) if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]
    firsts = [r for r in metrics(run_dir) if any(k.startswith("time_to_first_step_s/") for k in r)]
    assert len(firsts) == 2
    assert any("simulated/tau" in r for r in metrics(run_dir))
    final = [r for r in metrics(run_dir) if "real/tau" in r]  # the real eval runs in the final evaluation
    assert len(final) == 1 and final[0]["step"] == 24 and final[0]["real/lossless_mismatches"] == 0
    assert final[0]["real/prompts"] >= 1  # real/tau itself is checked against an untrained drafter below
    counted = [r for r in metrics(run_dir) if "data/samples" in r]  # at the launch's start and its end
    assert [r["step"] for r in counted] == [0, 24] and counted[-1]["data/held_out"] == 16
    regenerated = counted[-1]["data/samples"] + counted[-1]["data/dropped"]  # so far: samples and voids
    assert 0 < regenerated <= 3000 - 16 and counted[0]["data/samples"] == 0  # at the start: none yet
    assert "24 steps in" in first.stderr and "data: " in first.stderr and "samples dropped: " in first.stderr

    second = launch("--resume", str(run_dir), "--max-steps", "40")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming from step-00000024" in second.stderr
    assert "trained 16 steps this launch (step 24 -> 40)" in second.stderr, second.stderr
    state2 = read_trainer_state(latest_checkpoint(run_dir))
    assert state2.step == 40
    ledger2 = Ledger.from_dict(state2.ledger)
    assert trained_first < ledger2.trained(0) or ledger2.current_epoch() > 0
    assert ledger2.duplicates == 0
    # The trained drafter exports to the reference format and evaluates against the target.
    exported = tmp_path / "export"
    out = cli("export", str(run_dir), str(exported))
    assert out.returncode == 0, out.stderr
    assert (exported / "config.json").exists() and (exported / "model.safetensors").exists()
    untrained = untrained_export(exported, tmp_path / "untrained")
    tau, tau_untrained = eval_tau(exported), eval_tau(untrained)
    # The 40 steps learnt what the target accepts: an untrained drafter gets nothing accepted (1.0). The
    # trained tau differs between runs of the same code (1.183 in two fresh-clone suites, 1.313 run alone;
    # not pinned down: the order in which regenerated replies reach the two workers is one candidate).
    assert tau > tau_untrained + 0.1, (tau_untrained, tau)
    steps = [r["step"] for r in metrics(run_dir) if "loss" in r]
    assert steps[-2:] == [30, 40]  # logged every 10 steps, continuing after 24
    assert [r["step"] for r in metrics(run_dir) if "simulated/tau" in r] == [24, 40]
    assert [r["step"] for r in metrics(run_dir) if "real/tau" in r] == [24, 40]


def test_fresh_launch_refuses_a_run_dir_with_checkpoints(tmp_path: Path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.json").write_text("{}")
    out = launch("--run-dir", str(run_dir), "--device", "cpu", "--max-steps", "1")
    assert out.returncode == 2
    assert "--resume" in out.stderr
