"""The run's signals (run/signals.py) in a child process: a first stop drains (or unwinds set-up), a second
one stops at once, the watchdog bounds a drain, the preemption signal only asks for a checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dflash_pipe.run.signals import parse_preempt_signal

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import os, sys, time
    from dflash_pipe.run.signals import Signals, StopNow

    def hard(reason, code):
        print("HARD", code, reason, flush=True)
        os._exit(code)

    sig = Signals(stop_timeout_s=float(sys.argv[1]), preempt="USR1", on_hard_stop=hard,
                  drainable=sys.argv[2] == "drain").install()
    try:
        print("READY", flush=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if sig.save.is_set():
                sig.save.clear()
                print("SAVE", flush=True)
            if sig.stop.is_set() and sys.argv[3] == "finish":
                print("DRAINED", sig.stop_name, flush=True)
                sys.exit(0)
            time.sleep(0.01)
    except StopNow as exc:
        print("STOPNOW", exc, flush=True)
        sys.exit(0)
    """
)


def _child(*args: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.readline().strip() == "READY"
    return proc


def test_a_first_stop_drains_and_the_preemption_signal_only_asks_for_a_checkpoint():
    proc = _child("30", "drain", "finish")
    proc.send_signal(signal.SIGUSR1)
    assert proc.stdout.readline().strip() == "SAVE"
    assert proc.poll() is None  # USR1 no longer kills: the run trains on
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().strip() == "DRAINED SIGTERM"
    assert proc.wait(timeout=10) == 0


def test_a_second_stop_signal_stops_at_once():
    proc = _child("30", "drain", "hang")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    line = proc.stdout.readline().strip()
    assert line == "HARD 130 a second SIGINT: stopped at once", line
    assert proc.wait(timeout=10) == 130


def test_a_sigterm_delivered_twice_at_once_is_one_request():
    """Slurm signals every process of the job and the batch script passes the signal on: not a second one."""
    proc = _child("30", "drain", "hang")
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert proc.poll() is None
    time.sleep(1.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().strip() == "HARD 143 a second SIGTERM: stopped at once"
    assert proc.wait(timeout=10) == 143


def test_a_drain_past_the_stop_timeout_stops_hard():
    started = time.monotonic()
    proc = _child("1", "drain", "hang")
    proc.send_signal(signal.SIGTERM)
    line = proc.stdout.readline().strip()
    assert line.startswith("HARD 1 the drain after SIGTERM took longer than 1 s (--stop-timeout)"), line
    assert proc.wait(timeout=10) == 1
    assert time.monotonic() - started < 15


def test_a_stop_during_set_up_unwinds_at_once():
    proc = _child("30", "setup", "hang")
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().strip() == "STOPNOW SIGTERM"
    assert proc.wait(timeout=10) == 0


@pytest.mark.parametrize(
    ("given", "name"), [("USR1", "USR1"), ("sigusr2", "USR2"), ("HUP", "HUP"), ("off", "off")]
)
def test_preempt_signal_names(given: str, name: str):
    assert parse_preempt_signal(given) == name


@pytest.mark.parametrize("given", ["TERM", "SIGINT", "KILL", "NOPE"])
def test_preempt_signal_refuses_what_cannot_mean_checkpoint_now(given: str):
    with pytest.raises(ValueError, match="--preempt-signal"):
        parse_preempt_signal(given)


def test_the_hard_stop_says_what_is_on_disk(tmp_path: Path):
    from dflash_pipe.launcher import checkpoint_note

    assert checkpoint_note(tmp_path, None) == "no checkpoint was written"
    ckpt = tmp_path / "checkpoints" / "step-00000007"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 7, "time": 1000.0, "ledger": {}}))
    (tmp_path / "checkpoints" / "latest").write_text("step-00000007\n")
    assert checkpoint_note(tmp_path, 999.0) == "the final checkpoint step-00000007 was written"
    assert checkpoint_note(tmp_path, 1001.0) == "no final checkpoint; the latest is step-00000007"
