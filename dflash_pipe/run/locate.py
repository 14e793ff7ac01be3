"""Which checkpoint of a run: the one ``export`` reads, and the one a resume starts from (verified against its
manifest; a damaged latest falls back to the newest intact older one, set aside, never deleted)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from dflash_pipe.run.checkpoint import hold_checkpoint, verify_checkpoint
from dflash_pipe.run.files import (
    CHECKPOINTS_DIR,
    DRAFTER_CONFIG,
    DRAFTER_WEIGHTS,
    LATEST,
    STEP_PREFIX,
    TRAINER_STATE,
    RunDirError,
)

DAMAGED_PREFIX = "damaged-"
"""A damaged checkpoint a resume stepped back from is renamed ``damaged-step-N`` (out of pruning's way)."""


@contextlib.contextmanager
def held_checkpoint(path: Path) -> Iterator[Path]:
    """``find_checkpoint``, held against a running run's pruning until the block ends (``export`` reads a
    live run: its latest can be pruned while it is verified and read). One pruned before the hold was
    taken is looked up again: the run has a newer latest by then."""
    for _ in range(3):
        ckpt = _locate(Path(path))
        with hold_checkpoint(ckpt):
            if ckpt.is_dir():
                _check(ckpt)
                yield ckpt
                return
    raise RunDirError(f"{path}: its latest checkpoint was pruned 3 times before it could be read; try again")


def find_checkpoint(path: Path) -> Path:
    """The checkpoint ``export`` reads: a checkpoint (step-N/), a run's checkpoints/ folder or a run dir (its
    latest), verified (weights and drafter config) against the manifest."""
    ckpt = _locate(Path(path))
    _check(ckpt)
    return ckpt


def _locate(path: Path) -> Path:
    if (path / DRAFTER_WEIGHTS).exists() or (path / TRAINER_STATE).exists():
        ckpt = path
    elif (path / LATEST).exists():
        ckpt = _pointed(path)
    elif (path / CHECKPOINTS_DIR).is_dir():
        if not (path / CHECKPOINTS_DIR / LATEST).exists():
            raise RunDirError(
                f"{path} is a run dir without checkpoints yet ({path / CHECKPOINTS_DIR}/latest is missing)."
            )
        ckpt = _pointed(path / CHECKPOINTS_DIR)
    else:
        raise RunDirError(
            f"{path} is not a checkpoint: give a run dir (holding {CHECKPOINTS_DIR}/), its {CHECKPOINTS_DIR}/ folder "
            f"(holding {LATEST}) or one checkpoint (step-N/, holding {DRAFTER_WEIGHTS})."
        )
    return ckpt


def _check(ckpt: Path) -> None:
    problem = verify_checkpoint(ckpt, files=(DRAFTER_WEIGHTS, DRAFTER_CONFIG))
    if problem is not None:
        others = ", ".join(p.name for p in _steps(ckpt.parent) if p != ckpt) or "none"
        raise RunDirError(
            f"cannot export {ckpt}: {problem}. Export another checkpoint of the run instead (there: {others}), "
            f"e.g. `dflash-pipe export {ckpt.parent}/step-N OUT`."
        )
    if _trained_steps(ckpt) == 0:
        raise RunDirError(
            f"cannot export {ckpt}: it was trained 0 steps, so its drafter is the untrained initialization. "
            "Train the run first (dflash-pipe launch --resume RUN_DIR), or export a checkpoint with steps."
        )


def _trained_steps(ckpt: Path) -> int | None:
    """The step of a checkpoint's trainer_state.json (None: none there, or not readable: not ours to judge)."""
    try:
        step = json.loads((ckpt / TRAINER_STATE).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


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
    return sorted(p for p in Path(root).glob(f"{STEP_PREFIX}*") if p.is_dir())


def choose_checkpoint(run_dir: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from and the warnings about it: ``latest`` if intact, else the newest intact
    older one (the damaged one renamed ``damaged-step-N``, nothing deleted, ``latest`` repointed)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
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
