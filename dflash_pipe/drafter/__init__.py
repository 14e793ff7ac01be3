"""Drafter: the DFlash draft model, its training objective, export and acceptance evaluation (simulated, and
real by speculative decoding).

Names load on first use (PEP 562), so the torch-free parts (config, presets) stay cheap to import for the
CLI; ``from dflash_pipe.drafter import DFlashDrafter`` works as before.
"""

from __future__ import annotations

from dflash_pipe import lazy_exports

_EXPORTS = {
    "AcceptanceCounts": ".acceptance",
    "acceptance": ".acceptance",
    "CheckpointPolicy": ".checkpointing",
    "DrafterConfig": "dflash_pipe.config.drafter",
    "AcceptanceResult": ".evaluate",
    "evaluate_acceptance": ".evaluate",
    "render_acceptance_table": ".evaluate",
    "export_checkpoint": ".export",
    "export_drafter": ".export",
    "load_exported": ".export",
    "GenerateResult": ".generate_eval",
    "evaluate_generate": ".generate_eval",
    "render_generate_table": ".generate_eval",
    "DrafterOutput": ".loss",
    "DFlashDrafter": ".model",
    "PRESETS": "dflash_pipe.config.presets",
    "LosslessError": ".speculate",
    "speculative_generate": ".speculate",
    "load_frozen_target_parts": ".target_parts",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)
