"""The run a path names: its saved config.json, read from the path given (a moved run dir resumes itself)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_pipe import __version__
from dflash_pipe.producer.setup import CONFIG_FILE, RunDirError
from dflash_pipe.run.checkpoint import CHECKPOINTS, LATEST, TRAINER_STATE
from dflash_pipe.rundir.lock import read_owner

if TYPE_CHECKING:
    from dflash_pipe.run.config import RunConfig


def load_run_config(run_dir: Path) -> RunConfig:
    """The saved config of the run at ``run_dir``, with ``run_dir`` as its run dir: the path given is the run,
    wherever it was first started (a moved or copied run dir resumes itself, not the original)."""
    from dflash_pipe.run.config import RunConfig

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
