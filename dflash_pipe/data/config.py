"""Configuration of the data stage: where the samples come from and how they are cut."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
        if self.tokenize_workers is not None and self.tokenize_workers < 0:
            raise ValueError(
                f"DataConfig.tokenize_workers must be >= 0 (0 or 1: in-process) or None (automatic), got "
                f"{self.tokenize_workers}; leave it unset for one worker per core"
            )
