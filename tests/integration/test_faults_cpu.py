"""A live CPU run under stress: bad handshakes are refused, a late worker is welcomed, Ctrl-C drains (never a
hang). Worker faults, and workers that outlive a killed producer and wait to reconnect: test_elastic_cpu.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from dflash_pipe.run.checkpoint import latest_checkpoint, read_trainer_state
from dflash_pipe.wire import messages as m
from dflash_pipe.wire.codec import encode
from dflash_pipe.wire.transport import WorkerEndpoint
from tests.launch_flags import SMALL_RUN

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


class LiveRun:
    """``launch`` of two CPU workers on the demo target, at ``sizes`` (a one-layer drafter on short samples in
    small batches: the faults, the handshakes and the ledger are the same at any size, and a step takes ~0.2 s
    on 2 cores); ``args`` come last and win."""

    def __init__(self, run_dir: Path, *args: str, sizes: tuple[str, ...] = SMALL_RUN) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        cmd = [
            sys.executable,
            "-m",
            "dflash_pipe",
            "launch",
            "--plain",
            "--device",
            "cpu",
            "--workers",
            "2",
            "--run-dir",
            str(run_dir),
            *sizes,
            # faults and elasticity are about the feature path: the data's own responses, no real eval
            # (regeneration and real eval have their own end-to-end tests)
            "--responses",
            "dataset",
            "--eval-generate",
            "off",
            *args,
        ]
        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float = 180) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if found := re.search(pattern, line):
                    return found
            assert self.proc.poll() is None, "".join(self.lines)
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n" + "".join(self.lines))

    def wait_for_steps(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        metrics = self.run_dir / "metrics.jsonl"
        while time.monotonic() < deadline:
            if metrics.exists() and '"loss"' in metrics.read_text():
                return
            assert self.proc.poll() is None, "".join(self.lines)
            time.sleep(0.2)
        raise AssertionError("no training step logged:\n" + "".join(self.lines))

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return rc, "".join(self.lines)


def worker_pid(address: str, name: str) -> int:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"worker" in argv and address.encode() in argv and name.encode() in argv:
            return int(entry.name)
    raise AssertionError(f"no process for {name} at {address}")


def test_bad_handshakes_are_refused_and_ctrl_c_drains_to_a_checkpoint(tmp_path: Path):
    run = LiveRun(tmp_path / "run", "--max-steps", "100000", "--checkpoint-every", "100000")
    address = run.wait_for(r"producer at (tcp://\S+?),").group(1)
    run.wait_for_steps()

    # A peer speaking another protocol version is answered with REJECT, not ignored.
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(address)
    raw.send_multipart([msgpack.packb({"v": 99, "k": 1, "f": {}, "t": []})])
    assert raw.poll(10_000), "no answer to a bad protocol version"
    reply = msgpack.unpackb(raw.recv_multipart()[0])
    assert reply["k"] == m.Kind.REJECT and "99" in reply["f"]["reason"]
    raw.close(linger=0)

    # A well-formed worker arriving mid-run is welcomed (the group is elastic); vanishing is not fatal.
    late = WorkerEndpoint(address)
    late.send(m.Hello(worker_name="late", host="test", pid=1, device="cpu", capabilities=["frames"]))
    answer = None
    deadline = time.monotonic() + 10
    while answer is None or isinstance(answer, m.Heartbeat):
        assert time.monotonic() < deadline
        answer = late.recv(timeout_s=1.0)
    assert isinstance(answer, m.Welcome), answer
    late.close()

    # Peers that say HELLO and hang up at once (before WELCOME and the eval set reach them) are dropped.
    for i in range(10):
        rude = ctx.socket(zmq.DEALER)
        rude.connect(address)
        hello = m.Hello(worker_name=f"rude{i}", host="test", pid=2, device="cpu", capabilities=["frames"])
        rude.send_multipart(encode(hello))
        rude.close(linger=0)
    metrics = run.run_dir / "metrics.jsonl"
    steps_before = metrics.read_text().count('"loss"')
    deadline = time.monotonic() + 60
    while metrics.read_text().count('"loss"') <= steps_before:
        assert run.proc.poll() is None and time.monotonic() < deadline, "".join(run.lines)
        time.sleep(0.5)

    # The run is unharmed; Ctrl-C now drains it to a checkpoint and a clean exit.
    run.proc.send_signal(signal.SIGINT)
    rc, out = run.finish()
    assert rc == 0, out
    assert "stopped by SIGINT: final checkpoint" in out, out
    ckpt = latest_checkpoint(run.run_dir)
    assert ckpt is not None and read_trainer_state(ckpt).step >= 1
