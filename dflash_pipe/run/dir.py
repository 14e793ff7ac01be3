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
from dflash_pipe.run.files import RunDirError
from dflash_pipe.run.lock import RunDirLock, read_owner

if TYPE_CHECKING:
    from dflash_pipe.run.config import RunConfig

_PATH_KEYS = (("data", "path"), ("target_model",), ("compile_cache",), ("wire", "keys"))
"""Paths of a config that a launch reads relative to the directory it runs in."""


@dataclass(frozen=True, slots=True)
class RunDir:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        return self.root / files.CONFIG_FILE

    @property
    def metrics(self) -> Path:
        return self.root / files.METRICS_FILE

    @property
    def tensorboard(self) -> Path:
        return self.root / files.TENSORBOARD_DIR

    @property
    def logs(self) -> Path:
        return self.root / files.LOGS_DIR

    def worker_log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    @property
    def compile_cache(self) -> Path:
        """The default compile cache (``RunConfig.cache_dir`` says which one a run uses)."""
        return self.root / files.COMPILE_CACHE_DIR

    @property
    def samples(self) -> Path:
        return self.root / files.SAMPLES_DIR

    @property
    def regenerated(self) -> Path:
        return self.root / files.REGENERATED_FILE

    @property
    def report(self) -> Path:
        return self.root / files.REPORT_DIR

    @property
    def export(self) -> Path:
        return self.root / files.EXPORT_DIR

    @property
    def record(self) -> Path:
        return self.root / files.RECORD_FILE

    @property
    def owner(self) -> Path:
        return self.root / files.OWNER_FILE

    @property
    def checkpoints(self) -> Path:
        return self.root / files.CHECKPOINTS_DIR

    @property
    def latest(self) -> Path:
        """The pointer file naming the latest checkpoint (``latest_checkpoint`` follows it)."""
        return self.checkpoints / files.LATEST

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

    def lock(self, check: Callable[[], list[str]] | None = None) -> RunDirLock:
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
