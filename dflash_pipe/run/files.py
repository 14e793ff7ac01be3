"""What a run directory holds, by name, and the error a run dir that does not fit what was asked raises.

Every name of the run dir's layout is declared here once; ``RunDir`` (``run/dir.py``) turns them into paths
(what each one holds is said there) and the other modules of ``run/`` read them from here. Nothing outside ``run/`` spells one: it asks
``RunDir`` (``tests/run/test_run_dir_names.py`` reads ``NAMES`` and fails on a module that does). This
module imports nothing, so every module of ``run/`` can read it without an import cycle.
"""

from __future__ import annotations

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
LOGS_DIR = "logs"
COMPILE_CACHE_DIR = "compile-cache"
SAMPLES_DIR = "samples"
REGENERATED_FILE = "regenerated.jsonl"
REPORT_DIR = "report"
EXPORT_DIR = "export"
RECORD_FILE = "producer.json"
ATTACHED_DIR = "producers"
"""``producers/NAME/``: an attaching producer's own metrics and its workers' logs."""
LOCK_FILE = ".lock"
OWNER_FILE = "owner.json"

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
