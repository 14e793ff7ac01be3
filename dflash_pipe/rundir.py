"""The run directory as a whole: who owns it, which run a path names, and what a resume checks first.

One launch writes into a run directory at a time. ``RunDirLock`` holds an OS file lock (``filelock``) on
RUN_DIR/.lock for the launch's lifetime and records its owner (pid, host, command, version) in
RUN_DIR/owner.json, so a second launch is refused before it writes or spawns anything, naming the process.
The OS drops the lock of a process that dies (SIGKILL, OOM); its owner.json, never marked released, tells
the next launch to take the run dir over with a warning. ``report`` and ``export`` only read a run
(``report`` writes its PNGs under RUN_DIR/report/, which a launch never touches), so they take no lock.

``--resume PATH`` resumes PATH, wherever it now is (``load_run_config``); ``check_resume`` then finds the
checkpoint to resume from (verified against its manifest; a damaged latest falls back to the previous intact
one, set aside, never deleted), reports a cut-short metrics line, and stops a finished run with one line
saying how to train on. Each problem is one line naming the file and what to do.
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
from typing import TYPE_CHECKING, Any

from filelock import FileLock, Timeout

from dflash_pipe import __version__
from dflash_pipe.producer.setup import CONFIG_FILE, RunDirError, check_run_dir
from dflash_pipe.train.checkpoint import (
    CHECKPOINTS,
    DRAFTER_CONFIG,
    DRAFTER_WEIGHTS,
    LATEST,
    TRAINER_STATE,
    read_trainer_state,
    verify_checkpoint,
)
from dflash_pipe.train.ledger import Ledger

if TYPE_CHECKING:
    from dflash_pipe.config import RunConfig
    from dflash_pipe.producer.setup import RunContext

LOCK_FILE = ".lock"
OWNER_FILE = "owner.json"
METRICS_FILE = "metrics.jsonl"
DAMAGED_PREFIX = "damaged-"
"""A damaged checkpoint a resume stepped back from is renamed ``damaged-step-N`` (out of pruning's way)."""


class RunDirBusy(RunDirError):
    """Another live launch owns the run directory."""


class RunComplete(Exception):
    """``--resume`` of a run with nothing left to train; the message says how to train on."""


class RunDirLock:
    """The launch's hold on its run directory: ``with RunDirLock(run_dir, check=...) as lock:``.

    ``check`` runs with the lock held, before owner.json is written: a launch it refuses (a fresh run over
    an old one, a finished run) leaves the run dir as it was. ``lock.notes`` holds the warnings: a dead owner
    taken over, and what ``check`` returned. Release is safe to call twice."""

    def __init__(self, run_dir: Path, check: Callable[[], list[str]] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.check = check
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
                self.notes += self.check()
        except BaseException:
            self._lock.release()
            self._held = False
            raise
        self._record = owner_record()
        _write_json(self.run_dir / OWNER_FILE, self._record)

    def _check_previous(self, previous: dict[str, Any]) -> None:
        if not previous or previous.get("released") or _is_self(previous):
            return
        if previous.get("host") == socket.gethostname() and _is_dflash_process(int(previous.get("pid", -1))):
            raise RunDirBusy(
                f"{self.run_dir / OWNER_FILE} names {describe_owner(previous)}, which still runs, but the lock "
                f"file {self.run_dir / LOCK_FILE} is free: this file system may not support file locks. "
                "Stop that process first; if it does not use this run dir, delete owner.json"
            )
        where = (
            "" if previous.get("host") == socket.gethostname() else " (on another host: make sure it stopped)"
        )
        self.notes.append(
            f"took over {self.run_dir} from {describe_owner(previous)}, which ended without releasing it "
            f"(killed?){where}"
        )

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        with contextlib.suppress(OSError):
            _write_json(self.run_dir / OWNER_FILE, {**self._record, "released": _now()})
        self._lock.release()

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


# --- the run at a path ---------------------------------------------------------------------------------


def load_run_config(run_dir: Path) -> RunConfig:
    """The saved config of the run at ``run_dir``, with ``run_dir`` as its run dir: the path given is the run,
    wherever it was first started (a moved or copied run dir resumes itself, not the original)."""
    from dflash_pipe.config import RunConfig

    run_dir = Path(run_dir)
    path = run_dir / CONFIG_FILE
    if not path.exists():
        raise RunDirError(
            f"--resume {run_dir}: no {CONFIG_FILE} there, so there is no run to resume.{_hint(run_dir)}"
        )
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    except (OSError, ValueError) as e:
        raise RunDirError(
            f"{path} cannot be read ({e}): the run's config is damaged. Restore it from a copy, or start a new "
            f"--run-dir (`dflash-pipe export {run_dir} OUT` still exports its latest checkpoint)."
        ) from None
    try:
        return RunConfig.from_dict({**data, "run_dir": str(run_dir)})
    except (ValueError, TypeError, KeyError) as e:
        written = read_owner(run_dir).get("version")
        by = f"dflash-pipe {written}" if written and written != __version__ else "another dflash-pipe version"
        with_it = f" (pip install dflash-pipe=={written})" if written and written != __version__ else ""
        raise RunDirError(
            f"{path} does not fit dflash-pipe {__version__} ({e}); it was written by {by}. Resume it with that "
            f"version{with_it}, or start a new --run-dir (`dflash-pipe export {run_dir} OUT` keeps its drafter)."
        ) from None


_PATH_KEYS = (("data", "path"), ("target_model",), ("compile_cache",), ("wire", "keys"))
"""Paths of a config that a launch reads relative to the directory it runs in."""


def save_run_config(cfg: RunConfig) -> None:
    """RUN_DIR/config.json, its input paths made absolute (they were just read from this directory), so
    ``--resume`` works from any directory; ``run_dir`` stays as given (a resume uses the path it is given)."""
    data = cfg.to_dict()
    for keys in _PATH_KEYS:
        parent = data
        for key in keys[:-1]:
            parent = parent[key]
        value = parent[keys[-1]]
        if value is not None and not Path(value).is_absolute():
            parent[keys[-1]] = str(Path(value).resolve())
    (cfg.run_dir / CONFIG_FILE).write_text(json.dumps(data, indent=2) + "\n")


def _hint(path: Path) -> str:
    if (path / LATEST).exists() or (path / TRAINER_STATE).exists():
        return f" Give the run directory itself (the one holding {CONFIG_FILE} and {CHECKPOINTS}/)."
    return ""


def find_checkpoint(path: Path) -> Path:
    """The checkpoint ``export`` reads: a checkpoint (step-N/), a run's checkpoints/ folder or a run dir (its
    latest), verified (weights and drafter config) against the manifest."""
    path = Path(path)
    if (path / DRAFTER_WEIGHTS).exists() or (path / TRAINER_STATE).exists():
        ckpt = path
    elif (path / LATEST).exists():
        ckpt = _pointed(path)
    elif (path / CHECKPOINTS).is_dir():
        if not (path / CHECKPOINTS / LATEST).exists():
            raise RunDirError(
                f"{path} is a run dir without checkpoints yet ({path / CHECKPOINTS}/latest is missing)."
            )
        ckpt = _pointed(path / CHECKPOINTS)
    else:
        raise RunDirError(
            f"{path} is not a checkpoint: give a run dir (holding {CHECKPOINTS}/), its {CHECKPOINTS}/ folder "
            f"(holding {LATEST}) or one checkpoint (step-N/, holding {DRAFTER_WEIGHTS})."
        )
    problem = verify_checkpoint(ckpt, files=(DRAFTER_WEIGHTS, DRAFTER_CONFIG))
    if problem is not None:
        others = ", ".join(p.name for p in _steps(ckpt.parent) if p != ckpt) or "none"
        raise RunDirError(
            f"cannot export {ckpt}: {problem}. Export another checkpoint of the run instead (there: {others}), "
            f"e.g. `dflash-pipe export {ckpt.parent}/step-N OUT`."
        )
    return ckpt


def _pointed(root: Path) -> Path:
    """The checkpoint ``root/latest`` names; a pointer naming nothing is a RunDirError saying how to fix it."""
    pointer = root / LATEST
    try:
        name = pointer.read_text().strip()
    except OSError as e:
        raise RunDirError(f"{pointer} cannot be read ({e}).{_repoint(root)}") from None
    target = root / name
    if not name or "/" in name or not target.is_dir():
        raise RunDirError(
            f"{pointer} names {name!r}, which is not a checkpoint under {root}.{_repoint(root)}"
        )
    return target


def _repoint(root: Path) -> str:
    intact = [p.name for p in _steps(root) if verify_checkpoint(p) is None]
    if not intact:
        return (
            f" No intact checkpoint is left under {root}; restore one from a copy or start a new --run-dir."
        )
    return (
        f" Point it at an intact checkpoint (there: {', '.join(intact)}), e.g. "
        f"`echo {intact[-1]} > {root / LATEST}`."
    )


def _steps(root: Path) -> list[Path]:
    return sorted(p for p in Path(root).glob("step-*") if p.is_dir())


# --- before a resume -----------------------------------------------------------------------------------


def check_launch(cfg: RunConfig, *, resume: bool) -> list[str]:
    """The run dir checks of a launch, with its lock held: a fresh run never lands on an old one
    (``RunDirError``); a resume runs ``check_resume``."""
    check_run_dir(cfg.run_dir, resume=resume)
    return check_resume(cfg) if resume else []


def check_resume(cfg: RunConfig) -> list[str]:
    """What a resume checks before anything loads or spawns; returns warnings, raises ``RunDirError`` (one
    line: the file and the fix) or ``RunComplete``. Leaves ``checkpoints/latest`` naming the checkpoint the
    run resumes from."""
    run_dir = cfg.run_dir
    notes = _check_metrics(run_dir / METRICS_FILE)
    ckpt, more = choose_checkpoint(run_dir)
    notes += more
    if ckpt is None:
        return notes
    state = read_trainer_state(ckpt)
    try:
        ledger = Ledger.from_dict(state.ledger).with_epochs(cfg.train.epochs)
    except (ValueError, KeyError) as e:
        raise RunDirError(f"--resume {run_dir} --{e}") from None
    epochs_done = ledger.current_epoch() >= cfg.train.epochs or _recorded_complete(run_dir, ckpt, cfg)
    if message := complete_message(cfg, ckpt.name, state.step, epochs_done=epochs_done):
        raise RunComplete(message)
    return notes


def choose_checkpoint(run_dir: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from and the warnings about it: ``latest`` if intact, else the newest intact
    older one (the damaged one renamed ``damaged-step-N``, nothing deleted, ``latest`` repointed)."""
    root = Path(run_dir) / CHECKPOINTS
    steps = _steps(root) if root.is_dir() else []
    if not (root / LATEST).exists():
        if not steps:
            return None, []
        for cand in reversed(steps):
            if verify_checkpoint(cand) is None:
                _point(root, cand.name)
                return cand, [
                    f"{root / LATEST} is missing: resuming from the newest intact checkpoint, {cand.name}"
                ]
        raise RunDirError(
            f"{root / LATEST} is missing and no checkpoint under {root} is intact.{_repoint(root)}"
        )
    latest = _pointed(root)
    problem = verify_checkpoint(latest)
    if problem is None:
        return latest, []
    for cand in reversed([p for p in steps if p.name < latest.name]):
        if verify_checkpoint(cand) is None:
            aside = _set_aside(latest)
            _point(root, cand.name)
            return cand, [
                f"the latest checkpoint is damaged: {problem}. Resuming from {cand.name} instead; the damaged one "
                f"is kept as {aside} (nothing deleted)"
            ]
    raise RunDirError(
        f"--resume {run_dir}: the latest checkpoint is damaged: {problem}, and no older intact checkpoint is left "
        f"under {root}. Restore {latest.name} from a copy, or start a new --run-dir (nothing was changed)."
    )


def _set_aside(ckpt: Path) -> Path:
    aside = ckpt.with_name(DAMAGED_PREFIX + ckpt.name)
    n = 1
    while aside.exists():
        n += 1
        aside = ckpt.with_name(f"{DAMAGED_PREFIX}{ckpt.name}.{n}")
    os.replace(ckpt, aside)
    return aside


def _point(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.{os.getpid()}"
    tmp.write_text(name + "\n")
    os.replace(tmp, root / LATEST)


def _check_metrics(path: Path) -> list[str]:
    """A cut-short last line (the JSONL sink drops it when the run starts) and a bad line inside the file
    (``report`` stops there) are each named with what happens and what to do."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    notes = []
    lines = data.split(b"\n")
    if lines[-1]:
        notes.append(
            f"{path}: the last line is cut short ({len(lines[-1])} bytes; the previous launch died while "
            "writing it); it is dropped as this launch starts, every record before it stays"
        )
    for lineno, line in enumerate(lines[:-1], start=1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except ValueError:
            notes.append(
                f"{path}:{lineno} is not a JSON record (cut short or edited): training goes on, but "
                f"`dflash-pipe report` stops at it until the line is removed (sed -i '{lineno}d' {path})"
            )
            break
    return notes


# --- a finished run ------------------------------------------------------------------------------------

COMPLETE_KEY = "complete"
"""RUN_DIR/producer.json key: the checkpoint and epoch count of a launch that trained every epoch."""


def complete_message(cfg: RunConfig, checkpoint: str, step: int, *, epochs_done: bool) -> str | None:
    """One line for a resume that has nothing to train (every epoch trained, or ``max_steps`` reached), or
    None. It says how to train on."""
    max_steps = cfg.train.max_steps
    steps_done = max_steps is not None and step >= max_steps
    if not (epochs_done or steps_done):
        return None
    epochs = cfg.train.epochs
    why = [f"all {epochs} epoch(s) trained"] if epochs_done else []
    more = [f"--epochs {epochs + 1}"] if epochs_done else []
    if steps_done:
        why.append(f"step {step} reached max_steps {max_steps}")
        more.append(f"--max-steps {step + max(step, 1)}")
    run_dir = cfg.run_dir
    return (
        f"{run_dir} is complete: {' and '.join(why)} (checkpoint {checkpoint}, step {step}); nothing was started. "
        f"To train on: dflash-pipe launch --resume {run_dir} {' '.join(more)}; "
        f"to use the drafter: dflash-pipe export {run_dir} OUT"
    )


def check_open_work(ctx: RunContext) -> None:
    """After set-up, before the producer serves: a resumed run whose every epoch is trained (counting the
    regenerated conversations with nothing to train) raises ``RunComplete`` instead of serving nothing."""
    from dflash_pipe.producer.regen import first_open_epoch

    if ctx.resume_from is None:
        return
    voids = ctx.regen.voids if ctx.regen is not None else set()
    if first_open_epoch(ctx.ledger, voids) >= ctx.cfg.train.epochs:
        raise RunComplete(complete_message(ctx.cfg, ctx.resume_from.name, ctx.resume_step, epochs_done=True))


def record_complete(run_dir: Path, *, checkpoint: str | None, epochs: int) -> None:
    """Written when a launch trained every epoch: a later resume of that checkpoint knows the run is complete
    without the data (regenerated conversations with nothing to train never fill the ledger)."""
    from dflash_pipe.producer.record import write_record

    if checkpoint:
        write_record(run_dir, **{COMPLETE_KEY: {"checkpoint": Path(checkpoint).name, "epochs": epochs}})


def _recorded_complete(run_dir: Path, ckpt: Path, cfg: RunConfig) -> bool:
    from dflash_pipe.producer.record import read_record

    done = read_record(run_dir).get(COMPLETE_KEY) or {}
    return done.get("checkpoint") == ckpt.name and cfg.train.epochs <= int(done.get("epochs", 0))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")
