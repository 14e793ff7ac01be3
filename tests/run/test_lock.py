"""The run dir lock: a second holder is refused naming the first, a dead owner is taken over with a warning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from dflash_pipe.run.files import OWNER_FILE
from dflash_pipe.run.lock import RunDirBusy, RunDirLock, read_owner
from dflash_pipe.run.resume import LaunchCheck

ROOT = Path(__file__).resolve().parents[2]

HOLD = """
import sys
from filelock import FileLock
lock = FileLock(sys.argv[1], timeout=0)
lock.acquire()
print("held", flush=True)
sys.stdin.read()
"""


def holder(path: Path) -> subprocess.Popen:
    """Another process holding the lock file (plain filelock, as a launch holds it)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_owner_is_recorded_and_released(tmp_path: Path):
    run_dir = tmp_path / "new" / "run"
    with RunDirLock(run_dir) as lock:
        owner = read_owner(run_dir)
        assert owner["pid"] == os.getpid() and owner["command"].startswith("dflash-pipe")
        assert "released" not in owner and lock.notes == []
    released = read_owner(run_dir)
    assert released["released"] and released["started"] == owner["started"]
    lock.release()  # twice is safe
    with RunDirLock(run_dir) as again:  # a released run dir is taken without a warning
        assert again.notes == []


def test_a_second_holder_is_refused_naming_the_first(tmp_path: Path):
    first_owner = {"pid": 4242, "host": "nodeA", "command": "dflash-pipe launch --run-dir R", "started": "t0"}
    (tmp_path / OWNER_FILE).write_text(json.dumps(first_owner))
    proc = holder(tmp_path / ".lock")
    try:
        with pytest.raises(RunDirBusy) as err, RunDirLock(tmp_path):
            pass
        message = str(err.value)
        assert "pid 4242 on nodeA" in message and "dflash-pipe launch --run-dir R" in message
        assert "kill -INT 4242" in message and "--run-dir" in message
        assert json.loads((tmp_path / OWNER_FILE).read_text()) == first_owner  # nothing written
    finally:
        proc.stdin.close()
        proc.wait()
    with RunDirLock(tmp_path):  # free again once the holder is gone
        pass


def test_a_dead_owner_is_taken_over_with_a_warning(tmp_path: Path):
    import socket

    pid = dead_pid()
    stale = {"pid": pid, "host": socket.gethostname(), "command": "dflash-pipe launch", "started": "t0"}
    (tmp_path / OWNER_FILE).write_text(json.dumps(stale))
    with RunDirLock(tmp_path) as lock:
        assert len(lock.notes) == 1
        assert f"pid {pid}" in lock.notes[0] and "without releasing" in lock.notes[0]
        assert read_owner(tmp_path)["pid"] == os.getpid()


def test_a_live_owner_without_the_lock_is_not_taken_over(tmp_path: Path):
    """The owner still runs but the lock is free (a file system without locks): refuse, never share."""
    import socket

    script = "import sys; print('up', flush=True); sys.stdin.read()"
    proc = subprocess.Popen(
        [sys.executable, "-c", script, "dflash_pipe"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "up"  # running (its command line is the new one)
    try:
        owner = {
            "pid": proc.pid,
            "host": socket.gethostname(),
            "command": "dflash-pipe launch",
            "started": "t0",
        }
        (tmp_path / OWNER_FILE).write_text(json.dumps(owner))
        with pytest.raises(RunDirBusy, match="may not support file locks"), RunDirLock(tmp_path):
            pass
        probe = FileLock(tmp_path / ".lock", timeout=0)
        probe.acquire()  # the refusal released the lock it took
        probe.release()
        assert read_owner(tmp_path)["pid"] == proc.pid
        # the same record in a copy of a live run's dir: its owner holds the original, the copy is free
        (tmp_path / OWNER_FILE).write_text(json.dumps({**owner, "run_dir": str(tmp_path / "original")}))
        with RunDirLock(tmp_path) as lock:
            assert lock.notes == []
    finally:
        proc.stdin.close()
        proc.wait()


def test_a_refused_check_leaves_the_run_dir_as_it_was(tmp_path: Path):
    """The launch's checks run with the lock held and before owner.json is written."""
    previous = {"pid": 7, "host": "h", "command": "dflash-pipe launch", "started": "t0", "released": "t1"}
    (tmp_path / OWNER_FILE).write_text(json.dumps(previous))

    def refuse() -> LaunchCheck:
        raise RunDirBusy("refused")

    with pytest.raises(RunDirBusy, match="refused"), RunDirLock(tmp_path, check=refuse):
        pass
    assert read_owner(tmp_path) == previous
    checked = LaunchCheck(["a note"])
    with RunDirLock(tmp_path, check=lambda: checked) as lock:
        assert lock.notes == ["a note"] and read_owner(tmp_path)["pid"] == os.getpid()
        assert lock.checked is checked  # handed on to the launch
