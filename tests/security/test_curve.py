"""CURVE on the wire: keys admit a worker; no keys, other keys or an unlisted key are refused and logged."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import pytest

from dflash_pipe.run.config import WireConfig
from dflash_pipe.wire import Heartbeat, Hello, ProducerEndpoint, WorkerEndpoint
from dflash_pipe.wire.auth import AuthError, generate_keys

T = 5.0


@pytest.fixture
def key_dirs(tmp_path: Path) -> dict[str, Path]:
    """ "run": the producer's keys; "other": an unrelated set; "stranger": run's server key, other's client."""
    run, other = tmp_path / "run", tmp_path / "other"
    generate_keys(run)
    generate_keys(other)
    stranger = tmp_path / "stranger"
    shutil.copytree(other, stranger)
    shutil.copy(run / "server.key", stranger / "server.key")
    return {"run": run, "other": other, "stranger": stranger}


@pytest.fixture
def producer(key_dirs):
    with ProducerEndpoint("tcp://127.0.0.1:0", keys=key_dirs["run"]) as p:
        yield p


def test_worker_with_the_run_keys_is_served(producer, key_dirs):
    with WorkerEndpoint(producer.address, keys=key_dirs["run"]) as worker:
        hello = Hello(worker_name="w", host="h", pid=1, device="cpu", capabilities=["frames"])
        worker.send(hello)
        peer, got = producer.recv(T)
        assert got == hello
        producer.send(peer, Heartbeat(time=1.0))
        assert worker.recv(T) == Heartbeat(time=1.0)


def refused(producer: ProducerEndpoint, worker: WorkerEndpoint) -> str:
    """Drive both ends until the worker sees the refusal; the producer never receives a message."""
    deadline = time.monotonic() + T
    with pytest.raises(AuthError) as info:
        worker.send(Heartbeat(time=0.0))  # raises AuthError itself if it waited on refused handshakes
        while time.monotonic() < deadline:
            assert producer.recv(0.02) is None
            worker.recv(0.02)
    return str(info.value)


@pytest.mark.parametrize(
    "which, says",
    [
        (None, "requires CURVE keys and this worker has none"),
        ("other", "holds other keys than"),
        ("stranger", "refused the CURVE handshake"),
    ],
)
def test_worker_without_the_right_keys_is_refused_and_logged(producer, key_dirs, caplog, which, says):
    caplog.set_level(logging.WARNING, logger="dflash_pipe.wire")
    with WorkerEndpoint(producer.address, keys=key_dirs.get(which), send_timeout_s=1.0) as worker:
        message = refused(producer, worker)
    assert says in message and "--keys DIR" in message
    deadline = time.monotonic() + T
    while "refused" not in caplog.text and time.monotonic() < deadline:
        producer.recv(0.05)  # the producer logs handshake failures as it polls
    assert "refused" in caplog.text
    if which == "stranger":  # the right server key, an unlisted client key: ZAP says no and names the key
        assert producer.allow_list.refused >= 1
        assert "is not in" in caplog.text and str(key_dirs["run"] / "clients") in caplog.text


def test_producer_still_serves_after_refusals(producer, key_dirs):
    for which in (None, "other", "stranger"):
        with WorkerEndpoint(producer.address, keys=key_dirs.get(which), send_timeout_s=1.0) as worker:
            refused(producer, worker)
    test_worker_with_the_run_keys_is_served(producer, key_dirs)


def test_loopback_stays_key_free_and_public_needs_keys(key_dirs):
    with ProducerEndpoint("tcp://127.0.0.1:0") as p, WorkerEndpoint(p.address) as w:
        w.send(Heartbeat(time=2.0))
        assert p.recv(T)[1] == Heartbeat(time=2.0)
    with pytest.raises(ValueError, match="needs CURVE keys.*--keys DIR"):
        WorkerEndpoint("tcp://10.0.0.5:5555")
    with pytest.raises(ValueError, match="keys generate DIR"):
        WireConfig(bind="tcp://0.0.0.0:5555")
    assert WireConfig(bind="tcp://0.0.0.0:5555", keys=str(key_dirs["run"])).keys == key_dirs["run"]


def test_a_refused_key_is_logged_once_with_a_count(producer, key_dirs, caplog):
    caplog.set_level(logging.WARNING, logger="dflash_pipe.wire")
    for _ in range(3):  # a worker retrying with a key the producer does not list
        with WorkerEndpoint(producer.address, keys=key_dirs["stranger"], send_timeout_s=1.0) as worker:
            refused(producer, worker)
    for _ in range(20):
        producer.recv(0.02)
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert sum("first refusal of this key" in line for line in lines) == 1, lines
    assert len(lines) <= 2, lines  # the first, and at most the tenth's count
    assert sum(producer.allow_list.refused_keys.values()) >= 3 and len(producer.allow_list.refused_keys) == 1


@pytest.mark.slow
def test_a_worker_with_other_keys_stops_at_once_with_the_fix(producer, key_dirs):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "dflash_pipe", "worker", "--connect", producer.address, "--device", "cpu",
         "--keys", str(key_dirs["other"]), "--join-timeout", "60", "--reconnect-timeout", "300"],
        env={**os.environ, "PYTHONPATH": str(root)}, cwd=root, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "holds other keys than" in out.stderr and "--keys DIR" in out.stderr, out.stderr
    assert "Reconnecting" not in out.stderr and "--resume" not in out.stderr, out.stderr
    assert time.monotonic() - started < 60  # within --join-timeout, not --reconnect-timeout


@pytest.mark.parametrize("which", [None, "other", "stranger"])
def test_a_producer_attaching_without_the_run_keys_is_refused_like_a_worker(producer, key_dirs, which):
    """``dflash-pipe producer --connect`` meets the same CURVE gate as a worker: its HELLO never arrives,
    and it stops with the reason instead of waiting out its join timeout."""
    import threading

    from dflash_pipe.producer.attach import AttachError, join

    got: list = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if (msg := producer.recv(0.05)) is not None:
                got.append(msg)

    server = threading.Thread(target=serve)
    server.start()
    try:
        with WorkerEndpoint(producer.address, keys=key_dirs.get(which), send_timeout_s=1.0) as endpoint:
            t0 = time.monotonic()
            with pytest.raises(AttachError, match="this producer|CURVE") as info:
                join(endpoint, name="node1", devices=["cpu"], timeout_s=30.0)
            assert time.monotonic() - t0 < 10.0  # refused, not timed out
    finally:
        stop.set()
        server.join()
    assert "--keys DIR" in str(info.value) and got == []
