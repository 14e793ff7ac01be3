"""Drafter: the DFlash draft model, its training objective, export and acceptance evaluation (simulated, and
real by speculative decoding)."""

from .acceptance import AcceptanceCounts, acceptance
from .checkpointing import CheckpointPolicy
from .config import DrafterConfig
from .evaluate import AcceptanceResult, evaluate_acceptance, render_acceptance_table
from .export import export_checkpoint, export_drafter, load_exported
from .generate_eval import GenerateResult, evaluate_generate, render_generate_table
from .loss import DrafterOutput
from .model import DFlashDrafter
from .speculate import LosslessError, speculative_generate
from .target_parts import load_frozen_target_parts

__all__ = [
    "AcceptanceCounts",
    "AcceptanceResult",
    "CheckpointPolicy",
    "DFlashDrafter",
    "DrafterConfig",
    "DrafterOutput",
    "GenerateResult",
    "LosslessError",
    "acceptance",
    "evaluate_acceptance",
    "evaluate_generate",
    "export_checkpoint",
    "export_drafter",
    "load_exported",
    "load_frozen_target_parts",
    "render_acceptance_table",
    "render_generate_table",
    "speculative_generate",
]
