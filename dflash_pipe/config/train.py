"""Training hyper-parameters: by default the recipe of the DFlash reference (AdamW at 6e-4 with betas
(0.9, 0.95), 4% linear warm-up then cosine, grad clip 1.0, 6 epochs, 512 anchors per sequence)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from dflash_pipe.fields import build, check_choice, flag


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    lr: float = field(default=6e-4, metadata=flag("--lr", "Peak learning rate (recipe: 6e-4)."))
    """Peak AdamW learning rate."""
    warmup_ratio: float = 0.04
    """Fraction of the run spent warming the LR up linearly: of all planned samples, or of ``max_steps`` when
    those end the run first (the schedule then decays to the last step)."""
    min_lr_ratio: float = 0.0
    """Cosine decay floor, as a fraction of ``lr``."""
    epochs: int = field(
        default=6, metadata=flag("--epochs", "Epochs over the data (recipe: 6; demo: 1).", resume=True)
    )
    grad_clip: float = 1.0
    """Max global grad norm; 0 disables clipping."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    seed: int = field(default=0, metadata=flag("--seed", "Seed of data order and anchor sampling."))
    checkpoint_every: int = field(
        default=500, metadata=flag("--checkpoint-every", "Steps between checkpoints (default 500).")
    )
    """Steps between checkpoints (one is always written at the end)."""
    eval_every: int = field(
        default=0, metadata=flag("--eval-every", "Steps between tau evaluations (default: only at the end).")
    )
    """Steps between acceptance (tau) evaluations; 0 evaluates only at the end."""
    eval_generate: Literal["off", "end", "every"] = field(
        default="end",
        metadata=flag(
            "--eval-generate",
            "Real tau by speculative decoding of held-out prompts: in the final evaluation (end, default), "
            "at every evaluation, or off (the simulated tau only).",
            resume=True,
        ),
    )
    """Real acceptance by speculative decoding of held-out prompts (tau, per-position acceptance, tokens/s,
    lossless against greedy decoding) besides the simulated tau: in the final evaluation only ("end"), at
    every evaluation ("every": the other drafters wait while rank 0 decodes, so keep it well under
    wire.peer_timeout_s), or never ("off"). Rank 0 loads the whole target on its device for it."""
    eval_prompts: int = field(
        default=16,
        metadata=flag("--eval-prompts", "Held-out prompts the real tau decodes (default 16).", resume=True),
    )
    """Held-out prompts the real evaluation decodes (at most the held-out samples, `eval_samples`)."""
    eval_max_new_tokens: int = field(
        default=256,
        metadata=flag(
            "--eval-max-new-tokens",
            "Tokens per real-tau answer at most (default 256; demo 128).",
            resume=True,
        ),
    )
    """Each real-evaluation answer stops at its end-of-turn token or after this many tokens."""
    max_steps: int | None = field(
        default=None,
        metadata=flag(
            "--max-steps",
            "Stop after this many optimizer steps; the LR schedule warms up and decays over them when they end "
            "the run before its epochs do.",
            resume=True,
        ),
    )
    """Stop after this many optimizer steps (the demo uses it); None trains all epochs."""
    min_workers: int = field(
        default=1,
        metadata=flag(
            "--min-workers",
            "Take no step until this many drafters are in the group, over every node (like torchrun's "
            "--nnodes MIN:MAX; default 1: start with whoever is in). Workers of attached producers count.",
            resume=True,
        ),
    )
    """Drafters the group must hold before this launch's first optimizer step (a cluster starts at its full
    size instead of taking its first steps with the first node alone). Counted again at every launch
    (``--resume`` too); once the first step is taken, members that leave or die never stop the run."""
    compile: Literal["auto", "full", "attention", "off", "on"] = field(
        default="auto",
        metadata=flag(
            "--compile",
            "torch.compile the drafter. auto (default): full on CUDA, off on CPU; full: whole layers, the "
            "flex attention and fused CE terms; attention: the flex attention and block mask only (the "
            "fallback: 1.37x the step time at the Qwen3-8B shape); off: eager. on: the old name of "
            "attention.",
            param="compile_mode",
        ),
    )
    """torch.compile the drafter. full: each decoder layer whole (Inductor fuses the norms, RoPE and SwiGLU
    around the matmuls, flex attention inside), the LM head's softmax/CE terms as one kernel; attention: the
    flex kernel and block mask only (on the SDPA path: the layers); auto = full on CUDA, off on CPU; "on"
    is the old name of attention (run dirs of earlier versions keep it). A run checks its compiled step
    against an eager one at warm-up and falls back to attention if they disagree
    (``train.compile_check``); docs/performance.md has the sweep behind the default."""

    def compile_plan(self, device_type: str) -> Literal["full", "attention", "off"]:
        """What ``compile`` compiles on a device of this type, with ``auto`` and ``on`` resolved."""
        if self.compile == "auto":
            return "full" if device_type == "cuda" else "off"
        return "attention" if self.compile == "on" else self.compile

    compile_warmup: Literal["once", "each"] = field(
        default="each",
        metadata=flag(
            "--compile-warmup",
            "Workers starting together on an empty compile cache: each = all compile at once (default; the "
            "shortest time to the first step); once = one compiles, the others wait and start warm (least "
            "CPU).",
            resume=True,
        ),
    )
    """How workers that start together on an empty compile cache warm up. each: every worker compiles at
    the same time (no waiting; faster to the first step than once, docs/performance.md). once: one compiles
    under the cache's lock, the others wait and start warm (the least CPU work, for hosts with few cores
    per worker)."""
    activation_checkpointing: Literal["none", "layers", "loss", "all"] = field(
        default="none",
        metadata=flag(
            "--activation-checkpointing",
            "Recompute in backward: the draft layers, the LM-head loss, or both (default none).",
            resume=True,
        ),
    )
    """Recompute in backward instead of keeping: the draft layers' activations, the final norm + LM-head
    loss, or both (less memory, more compute; see drafter/checkpointing.py)."""
    log_every: int = 10

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # type: ignore[assignment]
        if not self.lr > 0:
            raise ValueError(f"train.lr must be > 0, got {self.lr}.")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"train.warmup_ratio must be in [0, 1), got {self.warmup_ratio}.")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}.")
        if self.epochs < 1:
            raise ValueError(f"train.epochs must be >= 1, got {self.epochs}.")
        if self.grad_clip < 0:
            raise ValueError(f"train.grad_clip must be >= 0 (0 disables), got {self.grad_clip}.")
        if self.checkpoint_every < 1:
            raise ValueError(f"train.checkpoint_every must be >= 1, got {self.checkpoint_every}.")
        if self.eval_every < 0:
            raise ValueError(f"train.eval_every must be >= 0, got {self.eval_every}.")
        check_choice(self, "eval_generate", "train.eval_generate")
        if self.eval_prompts < 1 or self.eval_max_new_tokens < 1:
            raise ValueError(
                f"train.eval_prompts and train.eval_max_new_tokens must be >= 1 (got {self.eval_prompts}, "
                f"{self.eval_max_new_tokens}); set train.eval_generate=off to skip the real evaluation."
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"train.max_steps must be >= 1 or unset, got {self.max_steps}.")
        if self.min_workers < 1:
            raise ValueError(
                f"train.min_workers (--min-workers) must be >= 1, got {self.min_workers}; 1 starts training "
                "with whoever is in."
            )
        for name in ("compile", "compile_warmup", "activation_checkpointing"):
            check_choice(self, name, f"train.{name}")
        if self.log_every < 1:
            raise ValueError(f"train.log_every must be >= 1, got {self.log_every}.")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (tuples as lists): what WELCOME carries to every worker."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Inverse of ``to_dict``, validated; a key this version does not know is named (a producer of
        another dflash-pipe version), not passed on as a TypeError."""
        return build(cls, values, "train", " (producer and worker run different dflash-pipe versions?)")
