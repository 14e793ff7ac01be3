"""The run directory as one capability: every path in it, the launch's lock on it, its saved config, the
checks a launch makes of it and where its checkpoints are.

``RunDir(path)`` is what the rest of the package asks; the names it builds paths from are in
``run/files.py`` and nowhere else. ``--resume PATH`` resumes PATH, wherever it now is
(``load_config``): a moved or copied run dir resumes itself, not the original. One launch writes into a
run dir at a time (``lock``, ``run/lock.py``); ``report`` and ``export`` only read a run, so they take no
lock.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_pipe import __version__
from dflash_pipe.run import files
from dflash_pipe.run.files import (
    CHECKPOINTS_DIR,
    COMPILE_CACHE_DIR,
    CONFIG_FILE,
    EXPORT_DIR,
    LATEST,
    LOGS_DIR,
    METRICS_FILE,
    OWNER_FILE,
    RECORD_FILE,
    REGENERATED_FILE,
    REPORT_DIR,
    SAMPLES_DIR,
    TENSORBOARD_DIR,
    RunDirError,
)
from dflash_pipe.run.lock import Checked, RunDirLock, read_owner

if TYPE_CHECKING:
    from dflash_pipe.run.config import RunConfig

_PATH_KEYS = (("data", "path"), ("target_model",), ("compile_cache",), ("wire", "keys"))
"""Paths of a config that a launch reads relative to the directory it runs in."""


class _Entry:
    """A path of the run dir: ``RunDir.root / name`` (a class attribute of ``RunDir``, read on an instance)."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def __get__(self, run: RunDir | None, owner: type | None = None) -> Path:
        if run is None:
            raise AttributeError("a RunDir path is read on a RunDir instance: RunDir(path).config")
        return run.root.joinpath(*self.names)


@dataclass(frozen=True, slots=True)
class RunDir:
    root: Path

    config = _Entry(CONFIG_FILE)
    """The resolved ``RunConfig`` (what ``--resume`` reads): ``save_config``, ``load_config``."""
    metrics = _Entry(METRICS_FILE)
    """Every launch appends its metrics here, one JSON record a line; ``report`` reads them, a resume checks
    the last line (``run/resume.py``)."""
    tensorboard, logs = _Entry(TENSORBOARD_DIR), _Entry(LOGS_DIR)
    """The TensorBoard sink's folder, and the worker processes' output (``worker_log``)."""
    compile_cache = _Entry(COMPILE_CACHE_DIR)
    """The default compile cache (``RunConfig.cache_dir`` says which one a run uses)."""
    samples, regenerated = _Entry(SAMPLES_DIR), _Entry(REGENERATED_FILE)
    """The tokenized samples on disk (``data.store``), reused by a resume with the same data and settings;
    with ``--responses target``, the target's own replies (``data.regenerated``)."""
    report, export = _Entry(REPORT_DIR), _Entry(EXPORT_DIR)
    """``dflash-pipe report``'s PNGs (a launch never touches them), and where ``serve-command RUN`` says to
    export the run's latest checkpoint to."""
    record, owner = _Entry(RECORD_FILE), _Entry(OWNER_FILE)
    """Where the producer listens and which worker processes it started (``run/record.py``); who holds the
    lock (``run/lock.py``)."""
    checkpoints = _Entry(CHECKPOINTS_DIR)
    latest = _Entry(CHECKPOINTS_DIR, LATEST)
    """The pointer file naming the latest checkpoint (``latest_checkpoint`` follows it)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    def worker_log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / files.step_name(step)

    def attached(self, name: str) -> RunDir:
        """An attaching producer's own run dir inside this one (its metrics and its workers' logs; the
        coordinator keeps the run's config and checkpoints)."""
        return RunDir(self.root / files.ATTACHED_DIR / name)

    @classmethod
    def of_checkpoint(cls, checkpoint: Path) -> RunDir | None:
        """The run dir a checkpoint belongs to (RUN/checkpoints/step-N -> RUN), None for one outside a run
        dir's checkpoints folder."""
        checkpoint = Path(checkpoint)
        return cls(checkpoint.parent.parent) if checkpoint.parent.name == files.CHECKPOINTS_DIR else None

    def has_run(self) -> bool:
        """Whether a run was started here (its config is saved)."""
        return self.config.exists()

    def has_checkpoints(self) -> bool:
        return self.has_run() and self.checkpoints.exists()

    def check(self, *, resume: bool) -> None:
        """A fresh run never lands on a run with checkpoints; a resume needs a run (``RunDirError``)."""
        from dflash_pipe.run.resume import check_run_dir

        check_run_dir(self.root, resume=resume)

    def lock(self, check: Callable[[], Checked] | None = None) -> RunDirLock:
        """The launch's hold on this run dir: ``with run_dir.lock(check=...) as lock:`` (``RunDirLock``)."""
        return RunDirLock(self.root, check=check)

    def read_owner(self) -> dict[str, Any]:
        return read_owner(self.root)

    def latest_checkpoint(self) -> Path | None:
        from dflash_pipe.run.checkpoint import latest_checkpoint

        return latest_checkpoint(self.root)

    def load_config(self) -> RunConfig:
        """The saved config of the run here, with this path as its run dir: the path given is the run,
        wherever it was first started."""
        from dflash_pipe.run.config import RunConfig

        path = self.config
        if not path.exists():
            raise RunDirError(
                f"--resume {self.root}: no {files.CONFIG_FILE} there, so there is no run to resume.{self._hint()}"
            )
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        except (OSError, ValueError) as e:
            raise RunDirError(
                f"{path} cannot be read ({e}): the run's config is damaged. Restore it from a copy, or start a "
                f"new --run-dir (`dflash-pipe export {self.root} OUT` still exports its latest checkpoint)."
            ) from None
        try:
            return RunConfig.from_dict({**data, "run_dir": str(self.root)})
        except (ValueError, TypeError, KeyError) as e:
            written = self.read_owner().get("version")
            other = bool(written) and written != __version__
            by = f"dflash-pipe {written}" if other else "another dflash-pipe version"
            with_it = f" (pip install dflash-pipe=={written})" if other else ""
            raise RunDirError(
                f"{path} does not fit dflash-pipe {__version__} ({e}); it was written by {by}. Resume it with "
                f"that version{with_it}, or start a new --run-dir (`dflash-pipe export {self.root} OUT` keeps "
                "its drafter)."
            ) from None

    def save_config(self, cfg: RunConfig) -> None:
        """The config file, its input paths made absolute (they were just read from this directory), so
        ``--resume`` works from any directory; ``run_dir`` stays as given (a resume uses the path it is
        given)."""
        data = cfg.to_dict()
        for keys in _PATH_KEYS:
            parent = data
            for key in keys[:-1]:
                parent = parent[key]
            value = parent[keys[-1]]
            if value is not None and not Path(value).is_absolute():
                parent[keys[-1]] = str(Path(value).resolve())
        self.root.mkdir(parents=True, exist_ok=True)
        self.config.write_text(json.dumps(data, indent=2) + "\n")

    def _hint(self) -> str:
        if (self.root / files.LATEST).exists() or (self.root / files.TRAINER_STATE).exists():
            return (
                f" Give the run directory itself (the one holding {files.CONFIG_FILE} and "
                f"{files.CHECKPOINTS_DIR}/)."
            )
        return ""
