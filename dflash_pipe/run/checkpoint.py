"""Checkpoints: drafter weights, optimizer, trainer state (step, ledger) and RNG, written atomically.

A checkpoint is built in a temporary directory and renamed into place, then the ``latest`` pointer is
replaced the same way: a crash (or a full disk) never leaves a half-written checkpoint as the latest.
Each one carries a manifest (every file's size and sha256 by 64 MiB pieces, read back from disk once
written), so a resume or an export can tell an intact checkpoint from one damaged since
(``verify_checkpoint``). Its files have the mode the umask says (0644 under umask 022), not safetensors' 0600.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflash_pipe.diskspace import free_bytes, is_no_space, no_space_error, space_note
from dflash_pipe.run.files import (
    CHECKPOINTS_DIR,
    DRAFTER_CONFIG,
    DRAFTER_WEIGHTS,
    LATEST,
    OPTIMIZER,
    RNG,
    STEP_PREFIX,
    TRAINER_STATE,
    step_name,
)

# The manifest lives in run.manifest (exports carry one too); its names still import from here.
from dflash_pipe.run.manifest import CHUNK_BYTES as CHUNK_BYTES
from dflash_pipe.run.manifest import MANIFEST as MANIFEST
from dflash_pipe.run.manifest import check_manifest, chmod_from_umask, write_json, write_manifest
from dflash_pipe.run.manifest import file_digests as file_digests

REQUIRED_FILES = (DRAFTER_WEIGHTS, DRAFTER_CONFIG, OPTIMIZER, RNG, TRAINER_STATE)
"""What a resume loads: a checkpoint missing any of them cannot be resumed."""


@dataclass(slots=True)
class TrainerState:
    step: int
    ledger: dict[str, Any]
    """Ledger.to_dict(): which samples these weights have been trained on, per epoch."""
    extra: dict[str, Any]


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The drafter's own weights; the frozen target embedding and LM head are never saved."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(
    run_dir: Path,
    *,
    step: int,
    model: torch.nn.Module,
    drafter_config: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    ledger: dict[str, Any],
    extra: dict[str, Any] | None = None,
    keep_last: int = 3,
    warn: Callable[[str], None] | None = None,
) -> Path:
    """Writes ``step-N`` and points ``latest`` at it. A full disk is ``DiskFullError`` (one line: path, bytes
    needed and free, what to do), before anything is written when the space is known to be short, and
    leaves the previous checkpoint as the latest and no temporary files; ``warn`` hears the early warning
    when this checkpoint fits but the next may not."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = step_name(step)
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    needed = checkpoint_bytes(root, model)
    fix = (
        f"Free space there (older checkpoints in {root} can go; keep `latest`) or move the run dir to a "
        "larger disk, then resume with `dflash-pipe launch --resume RUN_DIR`"
    )
    what = f"checkpoint {name}"
    if free_bytes(root) < needed:  # known not to fit: nothing is written, the previous one stays latest
        raise no_space_error(root, needed, what=what, fix=fix)
    if warn is not None and (note := space_note(root, needed, what="a checkpoint", fix=fix)):
        warn(note)
    try:
        tmp.mkdir()
        weights = {k: v.float().contiguous().cpu() for k, v in trainable_state(model).items()}
        save_file(weights, str(tmp / DRAFTER_WEIGHTS))
        write_json(tmp / DRAFTER_CONFIG, drafter_config)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER)
        torch.save(_rng_state(), tmp / RNG)
        write_json(
            tmp / TRAINER_STATE,
            {"step": step, "time": time.time(), "ledger": ledger, "extra": extra or {}},
        )
        for f in tmp.iterdir():  # safetensors writes 0600: the umask's mode, so another user may read it
            chmod_from_umask(f)
        write_manifest(tmp)
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and is_no_space(exc, root, needed):
            raise no_space_error(root, needed, what=what, fix=fix) from None
        raise
    pointer_tmp = root / f".{LATEST}.{os.getpid()}"
    try:
        pointer_tmp.write_text(name + "\n")
        os.replace(pointer_tmp, root / LATEST)
    except OSError as exc:
        pointer_tmp.unlink(missing_ok=True)
        if is_no_space(exc, root, 1):
            raise no_space_error(root, 4096, what=f"{root / LATEST} (pointing at {name})", fix=fix) from None
        raise
    _fsync_dir(root)
    _prune(root, keep_last)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = Path(run_dir) / CHECKPOINTS_DIR / LATEST
    if not pointer.exists():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / TRAINER_STATE).exists():
        raise FileNotFoundError(
            f"{pointer} points at {path.name}, which is missing or incomplete. Point it at an existing "
            f"checkpoint directory under {pointer.parent}."
        )
    return path


def checkpoint_bytes(root: Path, model: torch.nn.Module) -> int:
    """What the next checkpoint takes on disk: the newest one's size, else an estimate (fp32 weights plus
    AdamW's two moments, and a MiB for the rest)."""
    for previous in sorted((p for p in Path(root).glob(f"{STEP_PREFIX}*") if p.is_dir()), reverse=True):
        size = sum(f.stat().st_size for f in previous.iterdir() if f.is_file())
        if size:
            return size
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return 3 * 4 * numel + (1 << 20)


def written_at(path: Path) -> float | None:
    """When the checkpoint at ``path`` was written (its trainer state's time.time()), None if unreadable."""
    try:
        return float(json.loads((Path(path) / TRAINER_STATE).read_text())["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def verify_checkpoint(path: Path, files: Sequence[str] | None = None) -> str | None:
    """What is wrong with the checkpoint at ``path`` (one phrase naming the file), or None if it is intact.

    With a manifest, each file (``files``, default all listed) must be there with its recorded size and
    sha256. A checkpoint written before manifests existed is checked for its files and readable JSON only."""
    path = Path(path)
    if not path.is_dir():
        return f"{path} does not exist"
    if not (path / MANIFEST).exists():
        return _check_unmanifested(path, files or REQUIRED_FILES)
    return check_manifest(path, files, required=files or REQUIRED_FILES)


def _check_unmanifested(path: Path, files: Sequence[str]) -> str | None:
    for name in files:
        f = path / name
        if not f.is_file() or f.stat().st_size == 0:
            return f"{f} is missing or empty"
    for name in (n for n in (TRAINER_STATE, DRAFTER_CONFIG) if n in files):
        try:
            json.loads((path / name).read_text())
        except (OSError, ValueError) as e:
            return f"{path / name} is unreadable ({type(e).__name__}: {e})"
    return None


def read_trainer_state(path: Path) -> TrainerState:
    data = json.loads((Path(path) / TRAINER_STATE).read_text())
    return TrainerState(step=int(data["step"]), ledger=data["ledger"], extra=data.get("extra", {}))


def load_checkpoint(
    path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> TrainerState:
    path = Path(path)
    weights = load_file(str(path / DRAFTER_WEIGHTS))
    own = dict(model.named_parameters())
    missing = sorted(k for k, p in own.items() if p.requires_grad and k not in weights)
    unexpected = sorted(set(weights) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"Checkpoint {path} does not fit this drafter (missing {missing[:5]}, unexpected {unexpected[:5]}). "
            "Was it written for another target or drafter config?"
        )
    with torch.no_grad():
        for name, value in weights.items():
            own[name].copy_(value)
    if optimizer is not None:
        state = torch.load(path / OPTIMIZER, map_location="cpu", weights_only=True)
        optimizer.load_state_dict(state)
    rng = torch.load(path / RNG, map_location="cpu", weights_only=True)
    _restore_rng(rng)
    return read_trainer_state(path)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    py = random.getstate()
    state["python"] = torch.tensor(list(py[1]), dtype=torch.int64)
    state["python_pos"] = py[2] if py[2] is not None else -1
    state["python_version"] = py[0]
    return state


def _restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "python" in state:
        pos = state["python_pos"]
        random.setstate(
            (state["python_version"], tuple(state["python"].tolist()), None if pos == -1 else pos)
        )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


HOLD_PREFIX = ".hold-"
HOLD_TTL_S = 600.0
"""A hold older than this is ignored (its reader died): pruning is never blocked for long."""


@contextlib.contextmanager
def hold_checkpoint(ckpt: Path) -> Iterator[None]:
    """Keeps a live run's pruning off ``ckpt`` while another process reads it (``export`` of a running
    run): a file ``checkpoints/.hold-step-N-PID`` that ``_prune`` respects for ``HOLD_TTL_S``."""
    hold = ckpt.parent / f"{HOLD_PREFIX}{ckpt.name}-{os.getpid()}"
    try:
        hold.touch()
    except OSError:  # a read-only folder holds no live run to prune it
        yield
        return
    try:
        yield
    finally:
        hold.unlink(missing_ok=True)


def _held(root: Path) -> set[str]:
    now, names = time.time(), set()
    for hold in root.glob(f"{HOLD_PREFIX}{STEP_PREFIX}*"):
        with contextlib.suppress(OSError):
            if now - hold.stat().st_mtime < HOLD_TTL_S:
                names.add(hold.name.removeprefix(HOLD_PREFIX).rsplit("-", 1)[0])
    return names


def _prune(root: Path, keep_last: int) -> None:
    steps = sorted(p for p in root.glob(f"{STEP_PREFIX}*") if p.is_dir())
    held = _held(root)
    for old in steps[:-keep_last]:
        if old.name not in held:
            shutil.rmtree(old, ignore_errors=True)
