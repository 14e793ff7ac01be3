"""End to end on CPU with --responses target: a producer killed (SIGKILL) mid-regeneration, then launched
again on the same run dir, trains on the target's replies without generating what was written again."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_pipe.run.checkpoint import latest_checkpoint, read_trainer_state
from dflash_pipe.run.dir import RunDir
from dflash_pipe.run.ledger import Ledger
from tests.launch_flags import SMALL_DRAFTER, demo_subset

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONVERSATIONS = 60


def _cmd(run_dir: Path, data: Path) -> list[str]:
    flags = "--plain --device cpu --workers 1 --responses target --regen-batch 4 --token-budget 512 --max-length 256"
    return [
        sys.executable,
        "-m",
        "dflash_pipe",
        "launch",
        *flags.split(),
        *SMALL_DRAFTER,
        "--run-dir",
        str(run_dir),
        "--data",
        str(data),
    ]


def _finish(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    """Runs a launch to its end; it must succeed."""
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _records(path: Path) -> list[dict]:
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines[1:] if line.strip()]


def _index(record: dict) -> int:
    return (record.get("regen") or record["dflash_pipe"])["index"]


def _kill_run(run_dir: Path, proc: subprocess.Popen) -> None:
    """SIGKILL the producer, then the worker processes it had started (their pids are in its record)."""
    proc.kill()
    proc.wait(timeout=30)
    record = json.loads((run_dir / "producer.json").read_text())
    for worker in record.get("workers", []):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(worker["pid"]), signal.SIGKILL)


def test_killed_mid_regeneration_resumes_without_redoing(tmp_path: Path):
    """About a minute: a launch regenerating with the demo target is SIGKILLed part way, and the resume must reuse
    what the regenerated file already holds."""
    data = demo_subset(tmp_path / "data.jsonl", CONVERSATIONS)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(
        _cmd(run_dir, data), env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    regen_file = RunDir(run_dir).regenerated
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and first.poll() is None:
            if regen_file.exists() and regen_file.read_text().count("\n") >= 1 + 12:
                break
            time.sleep(0.05)
        assert first.poll() is None, "the run ended before it could be killed mid-regeneration"
    finally:
        _kill_run(run_dir, first)
    before = regen_file.read_bytes()
    written = _records(regen_file)
    n_train = CONVERSATIONS - CONVERSATIONS // 10
    assert 12 <= len(written) < CONVERSATIONS, len(written)

    # launched again: stops after 4 steps with a checkpoint (regeneration possibly still going)
    second = _finish(_cmd(run_dir, data) + ["--max-steps", "4", "--checkpoint-every", "2"], env)
    assert regen_file.read_bytes().startswith(before.rsplit(b"\n", 1)[0])  # the first run's lines kept
    assert f"({len(written)} reused" in second.stdout + second.stderr
    # --resume to the end of the epoch: nothing written is generated again
    third = _finish(
        [*_cmd(run_dir, data)[:4], "--plain", "--resume", str(run_dir), "--max-steps", "1000"], env
    )
    out = third.stdout + third.stderr
    assert "stopped: finished" in out and f"{n_train}/{n_train} conv" in out
    records = _records(regen_file)
    assert sorted(_index(r) for r in records) == list(range(CONVERSATIONS))  # each conversation once
    ledger = Ledger.from_dict(read_trainer_state(latest_checkpoint(run_dir)).ledger)
    voids = {_index(r) for r in records if "messages" not in r}
    assert ledger.count(0) + len(voids - ledger.trained(0)) == n_train  # every sample trained but voids
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in r for r in metrics) and any(k.startswith("regen/") for r in metrics for k in r)
    # the held-out tail, regenerated after training had started, reached the final evaluation
    assert any("simulated/tau" in r for r in metrics), "no evaluation on the regenerated held-out set"
    # the samples trained are the target's replies, not the dataset's
    source = [json.loads(line)["messages"] for line in data.read_text().splitlines()]
    changed = sum(
        r["messages"][1]["content"] != source[_index(r)][1]["content"] for r in records if "messages" in r
    )
    assert changed > CONVERSATIONS // 2
