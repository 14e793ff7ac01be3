"""End to end on CPU: one launch per run dir (a second is refused, the first unharmed, report and export read
it live), a killed run's dir taken over and resumed after a move, a finished run's resume that says so and
exits, and training on with more epochs from the last intact checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_pipe.run.checkpoint import OPTIMIZER, latest_checkpoint, read_trainer_state
from dflash_pipe.run.ledger import Ledger
from dflash_pipe.target import default_cache_dir
from tests.integration.test_faults_cpu import LiveRun
from tests.integration.test_launch_cpu import ROOT, cli, launch
from tests.launch_flags import SMALL_RUN, demo_subset

pytestmark = pytest.mark.slow


def loss_records(run_dir: Path) -> int:
    return (run_dir / "metrics.jsonl").read_text().count('"loss"')


def test_a_second_launch_is_refused_and_a_killed_run_resumes_after_a_move(tmp_path: Path):
    """About 90 s, most of it six processes' start-ups: a live launch, two refused launches beside it, a
    report and an export of it, then the killed run moved and resumed: the lock is only proven against a run
    that really holds it."""
    run_dir = tmp_path / "run"
    data = demo_subset(tmp_path / "data.jsonl", 200)
    args = ["--data", str(data), "--epochs", "100", "--max-steps", "100000", "--checkpoint-every", "3"]
    run = LiveRun(run_dir, "--workers", "1", *args)
    run.wait_for_steps()
    owner = json.loads((run_dir / "owner.json").read_text())
    assert owner["pid"] == run.proc.pid
    logs_before = sorted(p.name for p in (run_dir / "logs").iterdir())
    for second in (
        launch("--run-dir", str(run_dir), "--device", "cpu", "--max-steps", "1"),
        launch("--resume", str(run_dir)),
    ):
        assert second.returncode == 2, second.stderr
        assert f"is in use by pid {run.proc.pid}" in second.stderr and "Traceback" not in second.stderr
    assert json.loads((run_dir / "owner.json").read_text()) == owner
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == logs_before

    # report and export read the live run; it trains on, unharmed
    deadline = time.monotonic() + 120
    while latest_checkpoint(run_dir) is None:
        assert run.proc.poll() is None and time.monotonic() < deadline, "".join(run.lines)
        time.sleep(0.5)
    assert cli("report", str(run_dir), "--out", str(tmp_path / "report")).returncode == 0
    exported = cli("export", str(run_dir / "checkpoints"), str(tmp_path / "export"))
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "export" / "model.safetensors").exists()
    steps = loss_records(run_dir)
    while loss_records(run_dir) <= steps:
        assert run.proc.poll() is None and time.monotonic() < deadline, "".join(run.lines)
        time.sleep(0.5)

    # killed without releasing: the OS drops the lock, owner.json stays; its workers are stopped too
    workers = [w["pid"] for w in json.loads((run_dir / "producer.json").read_text())["workers"]]
    run.proc.kill()
    run.finish()
    for pid in workers:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)
    killed_at = read_trainer_state(latest_checkpoint(run_dir)).step
    original = sorted(p.name for p in (run_dir / "checkpoints").iterdir())

    # the moved run resumes itself, from another directory, taking the dead owner's lock over
    moved = tmp_path / "elsewhere" / "moved"
    shutil.copytree(run_dir, moved)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "dflash_pipe", "launch", "--plain", "--resume", str(moved)]
    cmd += ["--max-steps", str(killed_at + 2)]
    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"took over {moved} from pid {run.proc.pid}" in resumed.stderr
    assert f"resuming from step-{killed_at:08d}" in resumed.stderr
    assert read_trainer_state(latest_checkpoint(moved)).step == killed_at + 2
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == original  # the original untouched


def test_a_finished_run_says_so_and_trains_on_with_more_epochs(tmp_path: Path):
    """About 50 s in a full suite: three launches of one run dir, each with its own start-up. The first trains
    one epoch. The second must say the run is complete and start no worker. The third goes on to 2 epochs
    from the previous checkpoint, because the latest one is damaged. Each claim is about what a new process
    reads from the run dir."""
    data = demo_subset(tmp_path / "tiny.jsonl", 40)
    run_dir = tmp_path / "run"
    args = [
        "--device",
        "cpu",
        "--workers",
        "1",
        "--target-model",
        str(default_cache_dir()),
        "--data",
        str(data),
    ]
    args += [*SMALL_RUN, "--eval-generate", "off"]
    first = launch("--run-dir", str(run_dir), "--epochs", "1", "--checkpoint-every", "2", *args)
    assert first.returncode == 0, first.stderr
    end = read_trainer_state(latest_checkpoint(run_dir))
    assert Ledger.from_dict(end.ledger).current_epoch() == 1
    log = (run_dir / "logs" / "worker0.log").read_text()

    started = time.monotonic()
    again = launch("--resume", str(run_dir))
    assert again.returncode == 0, again.stderr
    assert time.monotonic() - started < 60
    assert (
        f"is complete: all 1 epoch(s) trained (checkpoint step-{end.step:08d}, step {end.step})"
        in again.stderr
    )
    assert f"--resume {run_dir} --epochs 2" in again.stderr
    assert (run_dir / "logs" / "worker0.log").read_text() == log  # no worker was started
    assert latest_checkpoint(run_dir).name == f"step-{end.step:08d}"

    # the latest checkpoint damaged: training on starts from the previous intact one, and says so
    (latest_checkpoint(run_dir) / OPTIMIZER).write_bytes(b"")
    more = launch("--resume", str(run_dir), "--epochs", "2")
    assert more.returncode == 0, more.stderr
    assert "the latest checkpoint is damaged" in more.stderr and "optimizer.pt has 0 bytes" in more.stderr
    assert (run_dir / "checkpoints" / f"damaged-step-{end.step:08d}" / OPTIMIZER).exists()
    state = read_trainer_state(latest_checkpoint(run_dir))
    ledger = Ledger.from_dict(state.ledger)
    assert ledger.epochs == 2 and ledger.current_epoch() == 2 and ledger.duplicates == 0
    assert state.step > end.step
