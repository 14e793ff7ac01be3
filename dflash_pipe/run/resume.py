"""What a launch checks with the run dir's lock held, before anything loads or spawns: a fresh run never lands
on an old one; a resume gets its checkpoint (``run.locate``), a note on cut-short metrics lines, and a
finished run stops with one line saying how to train on (``RunComplete``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_pipe.run.checkpoint import read_trainer_state
from dflash_pipe.run.files import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    LATEST,
    METRICS_FILE,
    TRAINER_STATE,
    RunDirError,
)
from dflash_pipe.run.ledger import Ledger
from dflash_pipe.run.locate import choose_checkpoint
from dflash_pipe.run.record import read_record, write_record

if TYPE_CHECKING:
    from dflash_pipe.run.config import RunConfig


class RunComplete(Exception):
    """``--resume`` of a run with nothing left to train; the message says how to train on."""


class NothingTrained(RunDirError):
    """``--resume`` of a run that trained 0 steps and has nothing it could train: never "complete"."""


def check_launch(cfg: RunConfig, *, resume: bool) -> list[str]:
    """The run dir checks of a launch, with its lock held: a fresh run never lands on an old one
    (``RunDirError``); a resume runs ``check_resume``."""
    check_run_dir(cfg.run_dir, resume=resume)
    return check_resume(cfg) if resume else []


def check_run_dir(run_dir: Path, *, resume: bool) -> None:
    """A fresh run never lands on a run with checkpoints; a resume needs a run (its config.json)."""
    has_config = (run_dir / CONFIG_FILE).exists()
    if resume and not has_config:
        raise RunDirError(f"--resume {run_dir}: no {CONFIG_FILE} there, so there is no run to resume.")
    if not resume and has_config and (run_dir / CHECKPOINTS_DIR).exists():
        raise RunDirError(
            f"--run-dir {run_dir} already holds a run with checkpoints. Continue it with "
            f"`dflash-pipe launch --resume {run_dir}`, or choose a new --run-dir."
        )


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
    try:
        state = read_trainer_state(ckpt)
        ledger = Ledger.from_dict(state.ledger)
    except (ValueError, KeyError, TypeError) as e:
        raise RunDirError(
            f"{ckpt / TRAINER_STATE} has no readable step and ledger ({type(e).__name__}: {e}). Point "
            f"{run_dir / CHECKPOINTS_DIR / LATEST} at an older checkpoint, or start a new --run-dir"
        ) from None
    try:
        ledger = ledger.with_epochs(cfg.train.epochs)
    except ValueError as e:
        raise RunDirError(f"--resume {run_dir} --{e}") from None
    epochs_done = ledger.current_epoch() >= cfg.train.epochs or _recorded_complete(run_dir, ckpt, cfg)
    if message := complete_message(cfg, ckpt.name, state.step, epochs_done=epochs_done):
        raise RunComplete(message)
    return notes


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


COMPLETE_KEY = "complete"
"""RUN_DIR/producer.json key: the checkpoint and epoch count of a launch that trained every epoch."""


def complete_message(cfg: RunConfig, checkpoint: str, step: int, *, epochs_done: bool) -> str | None:
    """One line for a resume that has nothing to train (every epoch trained, or ``max_steps`` reached), or
    None. It says how to train on. A run at step 0 trained nothing, so it is never complete (None)."""
    if step == 0:
        return None
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


def record_complete(run_dir: Path, *, checkpoint: str | None, epochs: int) -> None:
    """Written when a launch trained every epoch: a later resume of that checkpoint knows the run is complete
    without the data (regenerated conversations with nothing to train never fill the ledger)."""
    if checkpoint:
        write_record(run_dir, **{COMPLETE_KEY: {"checkpoint": Path(checkpoint).name, "epochs": epochs}})


def _recorded_complete(run_dir: Path, ckpt: Path, cfg: RunConfig) -> bool:
    done = read_record(run_dir).get(COMPLETE_KEY) or {}
    return done.get("checkpoint") == ckpt.name and cfg.train.epochs <= int(done.get("epochs", 0))
