"""The serve plan of a run dir or checkpoint: its latest checkpoint's drafter config, and the run's target and
chat template arguments from the run's config.json (``serve-command RUN``, the end of ``export``)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from dflash_pipe.drafter.config import DrafterConfig
from dflash_pipe.drafter.serve import TARGET_PLACEHOLDER, ServePlan, plan_from_export


def run_settings(checkpoint: Path) -> tuple[str | None, dict | None]:
    """(target path, chat template arguments) of the run a checkpoint belongs to, from the run's config.json
    (RUN/checkpoints/step-N -> RUN); (None, None) when the checkpoint is not inside a run dir or its config
    cannot be read."""
    from dflash_pipe.producer.setup import CONFIG_FILE
    from dflash_pipe.run.checkpoint import CHECKPOINTS

    from .config import load_run_config

    ckpt = Path(checkpoint)
    run_dir = ckpt.parent.parent
    if ckpt.parent.name != CHECKPOINTS or not (run_dir / CONFIG_FILE).is_file():
        return None, None
    try:
        cfg = load_run_config(run_dir)
    except ValueError:  # a damaged or other-version run config: the checkpoint still exports, unrecorded
        return None, None
    target = cfg.target_model
    if target is None:  # the built-in demo target, where launch builds it
        from dflash_pipe.target.demo import default_cache_dir

        target = default_cache_dir()
    return str(target), dict(cfg.data.chat_template_kwargs)


def plan_from_path(path: Path, *, target: str | None = None) -> ServePlan:
    """An export directory, or a run dir / checkpoint: its latest checkpoint's drafter config and the run's
    target and chat template arguments, served from the export ``dflash-pipe export PATH RUN/export``
    writes (printed as the step before; a checkpoint outside a run: STEP-export beside it)."""
    from dflash_pipe.drafter.export import CHECKPOINT_CONFIG, WEIGHTS_NAME
    from dflash_pipe.run.checkpoint import CHECKPOINTS

    from .checkpoints import find_checkpoint

    path = Path(path)
    if (path / WEIGHTS_NAME).is_file():  # an export (a run dir and a checkpoint have other weights)
        return plan_from_export(path, target=target)
    ckpt = find_checkpoint(path)
    run_target, kwargs = run_settings(ckpt)
    cfg = DrafterConfig.from_dict(json.loads((ckpt / CHECKPOINT_CONFIG).read_text()))
    # RUN/export for a run; beside a lone checkpoint (never inside it) otherwise
    in_run = ckpt.parent.name == CHECKPOINTS
    out = ckpt.parent.parent / "export" if in_run else ckpt.with_name(f"{ckpt.name}-export")
    return ServePlan(
        drafter=cfg,
        export_dir=out,
        target=target or run_target or TARGET_PLACEHOLDER,
        chat_template_kwargs=kwargs,
        export_first=f"dflash-pipe export {shlex.quote(str(path))} {shlex.quote(str(out))}",
    )
