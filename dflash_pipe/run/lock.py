"""RUN_DIR/.lock and RUN_DIR/owner.json: one launch writes into a run directory at a time.

``RunDirLock`` holds an OS file lock (``filelock``) for the launch's lifetime and records its owner (pid,
host, command, version) in owner.json, so a second launch is refused before it writes or spawns anything,
naming the process. The OS drops the lock of a process that dies (SIGKILL, OOM); its owner.json, never
marked released, tells the next launch to take the run dir over with a warning.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from filelock import FileLock, Timeout

from dflash_pipe import __version__
from dflash_pipe.run.files import LOCK_FILE, OWNER_FILE, RunDirError


class RunDirBusy(RunDirError):
    """Another live launch owns the run directory."""


class Checked(Protocol):
    """What a lock's check returns: at least its warnings."""

    notes: list[str]


class RunDirLock:
    """The launch's hold on its run directory: ``with RunDirLock(run_dir, check=...) as lock:``.

    ``check`` runs with the lock held, before owner.json is written: a launch it refuses (a fresh run over
    an old one, a finished run) leaves the run dir as it was. What it returns is kept as ``lock.checked``;
    ``lock.notes`` holds the warnings: a dead owner taken over, and the check's ``notes``. Release is safe to
    call twice."""

    def __init__(self, run_dir: Path, check: Callable[[], Checked] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.check = check
        self.checked: Checked | None = None
        self.notes: list[str] = []
        self._lock = FileLock(self.run_dir / LOCK_FILE, timeout=0)
        self._held = False
        self._record: dict[str, Any] = {}

    def acquire(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire()
        except Timeout:
            raise RunDirBusy(busy_message(self.run_dir, read_owner(self.run_dir))) from None
        self._held = True
        previous = read_owner(self.run_dir)
        try:
            self._check_previous(previous)
            if self.check is not None:
                self.checked = self.check()
                self.notes += self.checked.notes
        except BaseException:
            self._lock.release()
            self._held = False
            raise
        self._record = {**owner_record(), "run_dir": str(self.run_dir.resolve())}
        _write_json(self.run_dir / OWNER_FILE, self._record)

    def _check_previous(self, previous: dict[str, Any]) -> None:
        """A previous owner that never released: dead (take over, with a warning), or alive while the lock
        is free (refuse: the file system may not lock). A record copied with the run dir names the original."""
        if not previous or previous.get("released") or _is_self(previous):
            return
        here = previous.get("host") == socket.gethostname()
        recorded = previous.get("run_dir")
        copied = bool(recorded) and recorded != str(self.run_dir.resolve())
        if here and _is_dflash_process(int(previous.get("pid", -1))):
            if copied:  # it owns the original run dir, not this copy
                return
            raise RunDirBusy(
                f"{self.run_dir / OWNER_FILE} names {describe_owner(previous)}, which still runs, but the lock "
                f"file {self.run_dir / LOCK_FILE} is free: this file system may not support file locks. "
                f"Stop that process first; if it does not use this run dir, delete {OWNER_FILE}"
            )
        where = "" if here else " (on another host: make sure it stopped)"
        origin = f" (the record came with the copy from {recorded})" if copied else ""
        self.notes.append(
            f"took over {self.run_dir} from {describe_owner(previous)}, which ended without releasing it "
            f"(killed?){where}{origin}"
        )

    def release(self) -> None:
        if not self._held:
            return
        self.mark_released()
        self._held = False
        self._lock.release()

    def mark_released(self) -> None:
        """owner.json says the owner let go (a hard stop calls this from any thread, just before the
        process exits and the OS drops the file lock)."""
        if self._held:
            with contextlib.suppress(OSError):
                _write_json(self.run_dir / OWNER_FILE, {**self._record, "released": _now()})

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def owner_record() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": shlex.join(["dflash-pipe", *sys.argv[1:]]),
        "cwd": os.getcwd(),
        "started": _now(),
        "version": __version__,
    }


def read_owner(run_dir: Path) -> dict[str, Any]:
    """RUN_DIR/owner.json, or {} when there is none (or it cannot be read)."""
    try:
        owner = json.loads((Path(run_dir) / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def describe_owner(owner: dict[str, Any]) -> str:
    if not owner or owner.get("released"):  # the record is a previous owner's: the holder is starting
        return "another launch that is starting (its owner.json is not written yet)"
    return (
        f"pid {owner.get('pid', '?')} on {owner.get('host', '?')} (`{owner.get('command', '?')}`, "
        f"since {owner.get('started', '?')})"
    )


def busy_message(run_dir: Path, owner: dict[str, Any]) -> str:
    pid = None if owner.get("released") else owner.get("pid")
    stop = f"kill -INT {pid}" if pid else "Ctrl-C in its terminal"
    return (
        f"{run_dir} is in use by {describe_owner(owner)}. Wait for it to finish or stop it ({stop} drains "
        "it to a checkpoint), or choose another --run-dir; nothing was written or started."
    )


def _is_self(owner: dict[str, Any]) -> bool:
    return owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname()


def _is_dflash_process(pid: int) -> bool:
    """Whether ``pid`` runs dflash-pipe on this host (a reused pid of another program is not the owner)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and (b"dflash_pipe" in argv or b"dflash-pipe" in argv)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")
