"""How a producer's run stops early, raised by the core and the ring set-up and caught by the commands."""

from __future__ import annotations


class RunAborted(RuntimeError):
    """Every worker is gone, or a target replica failed; the run stopped (resume from the last checkpoint)."""


class NothingToTrain(RunAborted):
    """Regeneration left no sample to train: a resume would find the same, so none is suggested."""
