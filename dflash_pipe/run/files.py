"""What a run directory holds, by name, and the error a run dir that does not fit what was asked raises.

Every name of the run dir's layout is declared here once; ``RunDir`` (``run/dir.py``) turns them into paths
and the other modules of ``run/`` read them from here. Nothing outside ``run/`` spells one: it asks
``RunDir`` (``tests/run/test_run_dir_names.py`` reads ``NAMES`` and fails on a module that does). This
module imports nothing, so every module of ``run/`` can read it without an import cycle.
"""

from __future__ import annotations

CONFIG_FILE = "config.json"
"""The resolved ``RunConfig`` of the run (what ``--resume`` reads)."""
METRICS_FILE = "metrics.jsonl"
"""One JSON record per line: the metrics every launch appends (``report`` reads them)."""
TENSORBOARD_DIR = "tensorboard"
LOGS_DIR = "logs"
"""The worker processes' output, ``workerN.log``."""
COMPILE_CACHE_DIR = "compile-cache"
"""torch.compile's caches (Inductor, Triton) unless ``compile_cache`` names another folder."""
SAMPLES_DIR = "samples"
"""The tokenized samples on disk (``data.store``), reused by a resume with the same data."""
REGENERATED_FILE = "regenerated.jsonl"
"""The target's own replies with ``--responses target``."""
REPORT_DIR = "report"
"""``dflash-pipe report``'s PNGs (a launch never touches it)."""
EXPORT_DIR = "export"
"""Where ``serve-command RUN`` says to export the run's latest checkpoint."""
RECORD_FILE = "producer.json"
"""Where the producer listens and which worker processes it started."""
ATTACHED_DIR = "producers"
"""``producers/NAME/``: an attaching producer's own metrics and its workers' logs."""
LOCK_FILE = ".lock"
OWNER_FILE = "owner.json"
"""Who holds the lock: pid, host, command, version (and when it let go)."""

CHECKPOINTS_DIR = "checkpoints"
LATEST = "latest"
"""``checkpoints/latest``: the name of the newest intact checkpoint, one line."""
STEP_PREFIX = "step-"
"""``checkpoints/step-00000100/``: one checkpoint, zero-padded so names sort by step."""
DRAFTER_WEIGHTS = "drafter.safetensors"
DRAFTER_CONFIG = "drafter_config.json"
OPTIMIZER = "optimizer.pt"
TRAINER_STATE = "trainer_state.json"
RNG = "rng.pt"

NAMES = (
    CONFIG_FILE,
    METRICS_FILE,
    TENSORBOARD_DIR,
    LOGS_DIR,
    COMPILE_CACHE_DIR,
    SAMPLES_DIR,
    REGENERATED_FILE,
    REPORT_DIR,
    EXPORT_DIR,
    RECORD_FILE,
    ATTACHED_DIR,
    LOCK_FILE,
    OWNER_FILE,
    CHECKPOINTS_DIR,
    LATEST,
    DRAFTER_WEIGHTS,
    DRAFTER_CONFIG,
    OPTIMIZER,
    TRAINER_STATE,
    RNG,
)
"""Every name above: what no module outside ``run/`` may spell."""


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


class RunDirError(ValueError):
    """The run directory does not fit what was asked (fresh run over an old one, resume of nothing, a damaged
    checkpoint); the message names the file and what to do."""
