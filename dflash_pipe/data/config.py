"""Configuration of the data stage: where the samples come from and how they are cut."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

RESPONSES = ("dataset", "target")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where the training data is and how it is cut into samples and batches."""

    path: Path
    """JSONL file: one conversation (messages / ShareGPT) or one pre-tokenized sample per line."""
    max_length: int = 3072
    """Tokens per sample; longer samples are truncated (and counted in ``LoadedData.truncated``)."""
    token_budget: int = 4096
    """Maximum tokens per batch (sum of sample lengths); a longer single sample gets a batch of its own."""
    skip_bad_lines: bool = False
    """Skip malformed lines (counted per reason) instead of raising ``DataError`` on the first one."""
    min_loss_tokens: int = 2
    """Samples with fewer trainable anchor positions (p with loss_mask[p] and loss_mask[p+1]) are dropped."""
    tokenize_workers: int | None = None
    """Worker processes that tokenize the file in parallel (pieces of lines, merged in file order, so the
    samples are the same as in-process). None: one per CPU core but one, at most 16; 0 or 1: in-process.
    Files under 4 MiB are always tokenized in-process (starting a worker costs more than it saves)."""
    responses: Literal["dataset", "target"] = "dataset"
    """Which assistant turns are trained: "dataset" as the file has them; "target": the target regenerates
    every assistant turn first, turn by turn (``RegenConfig``), and the drafter trains on what it said."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra arguments of ``apply_chat_template`` (e.g. ``{"enable_thinking": false}``), used to render the
    training text and the regeneration prompts."""

    def __post_init__(self) -> None:
        if isinstance(self.path, str):
            self.path = Path(self.path)
        if not isinstance(self.path, Path):
            raise ValueError(f"DataConfig.path must be a path to a JSONL file, got {self.path!r}")
        if self.max_length < 2:
            raise ValueError(f"DataConfig.max_length must be >= 2, got {self.max_length}; use e.g. 3072")
        if self.token_budget < 1:
            raise ValueError(f"DataConfig.token_budget must be >= 1, got {self.token_budget}; use e.g. 16384")
        if self.min_loss_tokens < 0:
            raise ValueError(
                f"DataConfig.min_loss_tokens must be >= 0, got {self.min_loss_tokens}; use e.g. 2"
            )
        if self.responses not in RESPONSES:
            raise ValueError(
                f"DataConfig.responses must be dataset or target, got {self.responses!r}; use target to "
                "train on the target's own replies"
            )
        self.chat_template_kwargs = check_template_kwargs(self.chat_template_kwargs)
        if self.tokenize_workers is not None and self.tokenize_workers < 0:
            raise ValueError(
                f"DataConfig.tokenize_workers must be >= 0 (0 or 1: in-process) or None (automatic), got "
                f"{self.tokenize_workers}; leave it unset for one worker per core"
            )


def check_template_kwargs(value: Any) -> dict[str, Any]:
    """``chat_template_kwargs`` as a plain JSON-able dict with string keys, or ValueError naming the fix."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
        raise ValueError(
            f"data.chat_template_kwargs must be a mapping of argument names to values, got {value!r}; "
            'e.g. {"enable_thinking": false} (flag: --chat-template-arg enable_thinking=false)'
        )
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"data.chat_template_kwargs must hold JSON values (strings, numbers, booleans, lists), got {value!r}"
        ) from None
    return dict(value)


@dataclass(kw_only=True, slots=True)
class RegenConfig:
    """How the target regenerates assistant turns (``data.responses = "target"`` and ``dflash-pipe
    regenerate``). Every field but ``batch_size`` enters the regenerated file's provenance: a file made with
    other settings is not reused."""

    temperature: float = 0.0
    """0: greedy (the target's argmax, what lossless greedy speculative decoding serves); > 0: sampled."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1: all)."""
    top_k: int = 0
    """Keep only the k most likely tokens when sampling (0: no limit)."""
    seed: int = 0
    """Seeds sampling per (conversation, turn): a turn's tokens do not depend on batching or resume."""
    max_new_tokens: int = 1024
    """Tokens generated per assistant turn at most (also bounded by data.max_length); a turn cut here is
    kept and counted as truncated."""
    batch_size: int = 32
    """Conversations generated together (one batched decode per turn round)."""

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(
                f"regen.temperature must be >= 0 (0: greedy), got {self.temperature}; use 0 or e.g. 0.7"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"regen.top_p must be in (0, 1], got {self.top_p}; use 1 for no nucleus cut")
        if self.top_k < 0:
            raise ValueError(f"regen.top_k must be >= 0 (0: no limit), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"regen.max_new_tokens must be >= 1, got {self.max_new_tokens}; use e.g. 1024")
        if self.batch_size < 1:
            raise ValueError(f"regen.batch_size must be >= 1, got {self.batch_size}; use e.g. 32")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def provenance(self) -> dict[str, Any]:
        """The settings that decide what is generated (``batch_size`` does not: see ``seed``)."""
        out = asdict(self)
        del out["batch_size"]
        return out
