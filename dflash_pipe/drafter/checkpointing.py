"""Activation checkpointing of the drafter: the one place that wraps layers and the LM-head loss.

``--activation-checkpointing`` picks what is recomputed in backward instead of kept from the forward:

- ``none``: nothing (fastest, most memory);
- ``layers``: each draft layer keeps only its input and recomputes its activations in backward;
- ``loss``: the final norm, the scored-row gather and the chunked LM-head CE keep only their input;
- ``all``: both.

The mode says who runs the drafter. ``process``: one drafter per process, any checkpoint flavour.
``threaded``: several drafters as threads of one process (``--drafter-mode threads``); then only
non-reentrant checkpoints are allowed. A reentrant checkpoint re-runs the forward inside backward, on
autograd's own thread and with grad mode flipped, which is a new compiled variant compiled there while
other threads run compiled code (docs/architecture.md, "Threaded mode"); a reentrant request is refused
at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch.utils.checkpoint import checkpoint

CheckpointChoice = Literal["none", "layers", "loss", "all"]
CHECKPOINT_CHOICES: tuple[str, ...] = ("none", "layers", "loss", "all")
CheckpointMode = Literal["process", "threaded"]


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """What to checkpoint, for which mode, with which checkpoint flavour."""

    what: CheckpointChoice = "none"
    mode: CheckpointMode = "process"
    reentrant: bool = False
    """``use_reentrant=True`` (the old flavour); refused in threaded mode."""

    def __post_init__(self) -> None:
        if self.what not in CHECKPOINT_CHOICES:
            raise ValueError(
                f"activation checkpointing {self.what!r}: choose one of {', '.join(CHECKPOINT_CHOICES)}."
            )
        if self.mode not in ("process", "threaded"):
            raise ValueError(f"checkpoint mode {self.mode!r}: use 'process' or 'threaded'.")
        if self.reentrant and self.mode == "threaded":
            raise ValueError(
                "reentrant activation checkpointing is not allowed with --drafter-mode threads: it re-runs the "
                "forward on autograd's thread in backward, where it can compile while other drafter threads "
                "run compiled code. Use the default non-reentrant checkpoints (reentrant=False), or run the "
                "drafters as processes (--drafter-mode processes)."
            )

    @property
    def layers(self) -> bool:
        return self.what in ("layers", "all")

    @property
    def loss(self) -> bool:
        return self.what in ("loss", "all")

    def run_layer(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, checkpointed when the layers are."""
        return self._run(fn, args) if self.layers else fn(*args)

    def run_loss(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, checkpointed when the loss is. ``fn`` must return a tuple of tensors."""
        return self._run(fn, args) if self.loss else fn(*args)

    def _run(self, fn: Callable[..., Any], args: tuple) -> Any:
        # No RNG inside the drafter's layers or loss, so no RNG state to stash: forking the global RNG in
        # backward would also touch state other threads share.
        return checkpoint(fn, *args, use_reentrant=self.reentrant, preserve_rng_state=False)
