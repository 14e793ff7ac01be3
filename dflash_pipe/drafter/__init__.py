"""Drafter: the DFlash draft model, its training objective, export and acceptance evaluation."""

from .acceptance import AcceptanceCounts, acceptance
from .checkpointing import CheckpointPolicy
from .config import DrafterConfig
from .evaluate import AcceptanceResult, evaluate_acceptance, render_acceptance_table
from .export import export_checkpoint, export_drafter, load_exported
from .loss import DrafterOutput
from .model import DFlashDrafter
from .target_parts import load_frozen_target_parts

__all__ = [
    "AcceptanceCounts",
    "AcceptanceResult",
    "CheckpointPolicy",
    "DFlashDrafter",
    "DrafterConfig",
    "DrafterOutput",
    "acceptance",
    "evaluate_acceptance",
    "export_checkpoint",
    "export_drafter",
    "load_exported",
    "load_frozen_target_parts",
    "render_acceptance_table",
]
