"""What a launch checks with the run dir's lock held, before anything loads or spawns: a fresh run never lands
on an old one; a resume gets its checkpoint (``run.locate``), a note on cut-short metrics lines, and a
finished run stops with one line saying how to train on (``RunComplete``).

The resumed checkpoint is read here once (``ResumePoint``: step, ledger, drafter config) and handed on in
memory to the set-up, which checks the drafter it builds against it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_pipe.run.checkpoint import read_trainer_state
from dflash_pipe.run.files import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    DRAFTER_CONFIG,
    LATEST,
    METRICS_FILE,
    TRAINER_STATE,
    RunDirError,
)
from dflash_pipe.run.ledger import Ledger
from dflash_pipe.run.locate import choose_checkpoint
from dflash_pipe.run.record import recorded_complete

if TYPE_CHECKING:
    from dflash_pipe.run.config import RunConfig


class RunComplete(Exception):
    """``--resume`` of a run with nothing left to train; the message says how to train on."""


class NothingTrained(RunDirError):
    """``--resume`` of a run that trained 0 steps and has nothing it could train: never "complete"."""


RESUME_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "num_target_layers",
    "layer_types",
    "sliding_window",
)
"""Drafter fields a checkpoint must share with the resumed run (shapes and the meaning of the features)."""


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """The checkpoint a resume continues from, read once: its step, its ledger and the drafter config it was
    trained with (the drafter the set-up builds is checked against that config, ``check_fits``)."""

    checkpoint: Path
    step: int
    ledger: Ledger
    drafter_config: dict[str, Any]

    @classmethod
    def read(cls, checkpoint: Path, run_dir: Path) -> ResumePoint:
        """Reads the checkpoint's trainer state and drafter config; a damaged one raises ``RunDirError``
        naming the file and what to do."""
        try:
            state = read_trainer_state(checkpoint)
            ledger = Ledger.from_dict(state.ledger)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RunDirError(
                f"{checkpoint / TRAINER_STATE} has no readable step and ledger ({type(e).__name__}: {e}). Point "
                f"{run_dir / CHECKPOINTS_DIR / LATEST} at an older checkpoint, or start a new --run-dir"
            ) from None
        path = checkpoint / DRAFTER_CONFIG
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise RunDirError(
                f"--resume {run_dir}: cannot read {path} ({e}). The checkpoint is damaged; resume from an older "
                f"one by pointing {run_dir / CHECKPOINTS_DIR / LATEST} at it, or start a new --run-dir"
            ) from None
        return cls(checkpoint=checkpoint, step=state.step, ledger=ledger, drafter_config=saved)

    def check_fits(self, drafter: dict[str, Any], run_dir: Path, *, skip: tuple[str, ...] = ()) -> None:
        """A drafter (``DrafterConfig.to_dict()``) of another target or shape than the checkpoint's is
        refused, naming the first differing field (``skip``: fields not known yet)."""
        saved = self.drafter_config
        for name in RESUME_FIELDS:
            if name in saved and name not in skip and saved[name] != drafter[name]:
                raise RunDirError(
                    f"--resume {run_dir}: the checkpoint's drafter has {name}={saved[name]!r} but this run's "
                    f"target and drafter settings give {drafter[name]!r}; the target model, its config or a "
                    "drafter option changed since the checkpoint. Resume with the original target and options, "
                    "or start a new --run-dir"
                )


@dataclass(frozen=True, slots=True)
class LaunchCheck:
    """What the checks under the run dir's lock found: warnings to print, and a resume's checkpoint."""

    notes: list[str] = field(default_factory=list)
    resume: ResumePoint | None = None


def check_launch(cfg: RunConfig, *, resume: bool) -> LaunchCheck:
    """The run dir checks of a launch, with its lock held: a fresh run never lands on an old one
    (``RunDirError``); a resume runs ``check_resume``."""
    check_run_dir(cfg.run_dir, resume=resume)
    return check_resume(cfg) if resume else LaunchCheck()


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


def check_resume(cfg: RunConfig) -> LaunchCheck:
    """What a resume checks before anything loads or spawns: warnings and the checkpoint, read once (none
    for a run that wrote none yet); raises ``RunDirError`` (one line: the file and the fix) or
    ``RunComplete``. Leaves ``checkpoints/latest`` naming the checkpoint the run resumes from."""
    run_dir = cfg.run_dir
    notes = _check_metrics(run_dir / METRICS_FILE)
    ckpt, more = choose_checkpoint(run_dir)
    notes += more
    if ckpt is None:
        return LaunchCheck(notes)
    point = ResumePoint.read(ckpt, run_dir)
    try:
        ledger = point.ledger.with_epochs(cfg.train.epochs)
    except ValueError as e:
        raise RunDirError(f"--resume {run_dir} --{e}") from None
    epochs_done = ledger.current_epoch() >= cfg.train.epochs or recorded_complete(
        run_dir, ckpt, cfg.train.epochs
    )
    if message := complete_message(cfg, ckpt.name, point.step, epochs_done=epochs_done):
        raise RunComplete(message)
    return LaunchCheck(notes, point)


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
