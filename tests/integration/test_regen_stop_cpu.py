"""Ctrl-C while a slow target regenerates (2 CPU cores, long prompts, replies that run to the cap): the
drain stops the generation at once (between decode steps and prefill calls, not after the replies in
progress), keeps every conversation already finished in the regenerated file, and the launch exits within
--stop-timeout with a line saying what was kept."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_pipe.data import demo_data_path, demo_tokenizer
from tests.tiny_models import tiny_qwen3_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SHORT, LONG = 16, 64
STOP_TIMEOUT_S = 8


def _target(out: Path) -> Path:
    """Random weights: every greedy reply loops to --max-new-tokens; a 3K-token prompt takes ~1 s to
    prefill on one core, so 16 of them (one slot each) are ~16 s of prefill."""
    tok = demo_tokenizer()
    torch.manual_seed(0)
    config = tiny_qwen3_config(
        vocab_size=len(tok), max_position_embeddings=4096, hidden_size=256, intermediate_size=512, head_dim=64
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _data(path: Path) -> Path:
    """SHORT one-turn conversations (the first job: the window's shortest), then LONG ones of ~3K tokens
    (the rest, the held-out tail included)."""
    rows = [json.loads(line) for line in demo_data_path().read_text().splitlines()]
    text = " ".join(m["content"] for r in rows for m in r["messages"])
    prompts = [rows[i]["messages"][0]["content"] for i in range(SHORT)]
    prompts += [text[i * 997 : i * 997 + 10_000] for i in range(LONG)]
    with open(path, "w") as f:
        for prompt in prompts:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": "ok"}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[1:] if line.strip()]


def _joined(run_dir: Path) -> bool:
    """The worker is in its group (it waits for batches): a Ctrl-C finds it training, as in a real run."""
    log = run_dir / "logs" / "worker0.log"
    return log.exists() and "group generation" in log.read_text()


def test_sigint_mid_regeneration_stops_it_keeps_the_replies_and_exits_in_time(tmp_path: Path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dflash_pipe", "launch", "--plain", "--device", "cpu", "--workers", "1",
           "--target-model", str(_target(tmp_path / "target")), "--draft-layers", "1",
           "--data", str(_data(tmp_path / "data.jsonl")), "--responses", "target", "--regen-batch", "16",
           "--max-new-tokens", "64", "--max-length", "4096", "--eval-generate", "off",
           "--stop-timeout", str(STOP_TIMEOUT_S), "--run-dir", str(run_dir)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "launch.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    regen_file = run_dir / "regenerated.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not (_joined(run_dir) and regen_file.exists() and _records(regen_file)):  # the short job
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        finished = len(_records(regen_file))
        assert finished < SHORT + LONG
        signalled = time.monotonic()
        proc.send_signal(signal.SIGINT)  # the long prompts are prefilling now
        rc = proc.wait(timeout=60)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert rc == 0, out[-3000:]
    assert took < STOP_TIMEOUT_S, f"{took:.1f} s\n{out[-3000:]}"
    assert "SIGINT: draining" in out and "stopped hard" not in out, out[-3000:]
    records = _records(regen_file)
    indexes = [(r.get("regen") or r["dflash_pipe"])["index"] for r in records]
    assert len(set(indexes)) == len(indexes) >= finished  # every finished reply kept, each once
    total = SHORT + LONG
    kept = f"regeneration stopped with {len(records)}/{total} conversations in {regen_file}"
    assert kept in out and "--resume keeps them" in out, out[-3000:]
    capped = f"{len(records)} cut at the token limit: {len(records)} at --max-new-tokens 64; "
    assert capped in out and " ending in a loop)" in out, out[-3000:]  # every random reply runs to the cap
