"""The data stage's value types: one tokenized sample, a loaded dataset, and the error a bad input raises."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .formats import LEFT_OUT_EMPTY, LEFT_OUT_NO_ASSISTANT, LEFT_OUT_UNKNOWN_ROLE

if TYPE_CHECKING:  # the tokenization workers import this package and need no torch (2 s per start)
    import torch


DROP_TOO_LONG = "too long for max_length"
"""A sample that would train, cut by ``max_length`` to fewer than ``min_loss_tokens`` trainable positions."""
DROP_EMPTY_REPLIES = "empty assistant turns"
"""A conversation whose every assistant turn is empty: nothing to learn from."""
DROP_FEW_TOKENS = "too few trainable tokens"
"""A sample with fewer than ``min_loss_tokens`` trainable anchor positions at any length."""
DROP_NOT_REGENERATED = "not regenerated"
"""A regenerated file's record of a conversation the target could not answer."""


DROPS_NOT_SHORT = frozenset(
    {DROP_NOT_REGENERATED, LEFT_OUT_EMPTY, LEFT_OUT_NO_ASSISTANT, LEFT_OUT_UNKNOWN_ROLE}
)
"""Drop reasons that are not a sample too short to train (``LoadedData.dropped_short`` leaves them out)."""


class DataError(ValueError):
    """A problem with the input data. Message: ``"<file>:<line>: <reason>. <fix>"`` (or ``"<file>: ..."``)."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One training sequence; ``sample_id`` is its index in the loaded dataset (stable for a file + config)."""

    sample_id: int
    input_ids: torch.Tensor  # [S] int64
    loss_mask: torch.Tensor  # [S] bool; True on trained (assistant) tokens


@dataclass(slots=True)
class LoadedData:
    """The samples of one file plus what was left out, so a run can report it."""

    samples: Sequence[Sample]
    """A list, or with a store (``load_samples(..., store=DIR)``) a ``StoredSamples`` reading them from disk."""
    skipped_lines: int
    """Bad lines skipped (only with ``skip_bad_lines``); per reason in ``skip_reasons``."""
    truncated: int
    """Samples cut to ``max_length``."""
    dropped_short: int
    """Samples dropped for having fewer than ``min_loss_tokens`` trainable anchor positions."""
    skip_reasons: dict[str, int] = field(default_factory=dict)
    """Skipped lines by reason (e.g. ``"not JSON"``, ``"no assistant turn"``)."""
    drop_reasons: dict[str, int] = field(default_factory=dict)
    """Samples left out by reason (``DROP_*``): the ``dropped_short`` ones, split by why, a regenerated
    file's conversations the target could not answer, and conversations with nothing to train (empty, no
    assistant turn, an unknown role: ``formats.LEFT_OUT_*``)."""
    notes: list[str] = field(default_factory=list)
    """One line each about how the data was read (e.g. a JSON array file cut short: how many records)."""

    def lengths(self) -> list[int]:
        """Token count of every sample, indexed by ``sample_id`` (the input of ``plan_batches``)."""
        return sample_lengths(self.samples).tolist()

    @property
    def num_tokens(self) -> int:
        return int(sample_lengths(self.samples).sum())


def sample_lengths(samples: Sequence[Sample]) -> np.ndarray:
    """Token count per sample ([N] int64): a store's from its offsets (no sample read; 0 for a spilled slot
    not yet made), a list's per sample."""
    lengths = getattr(samples, "lengths", None)  # StoredSamples, SpilledSamples: from their offsets
    if callable(lengths):
        return np.asarray(lengths(), dtype=np.int64)
    return np.fromiter((s.input_ids.shape[0] for s in samples), dtype=np.int64, count=len(samples))


PRESENCE_CHUNK = 1 << 24
"""Tokens counted at a time by ``token_presence`` over a store (64 MiB of uint32 ids)."""


def token_presence(samples: Sequence[Sample | None], vocab_size: int) -> np.ndarray:
    """Which token ids the samples contain: [vocab_size] bool (ids past it are ignored). A store's from its
    id file in chunks (one pass, no ``Sample`` made); a list's per sample, None entries skipped."""
    seen = np.zeros(vocab_size, dtype=bool)
    chunks = getattr(samples, "token_ids", None)  # StoredSamples: the flat ids of its range
    if callable(chunks):
        flat = chunks()
        pieces = (flat[a : a + PRESENCE_CHUNK] for a in range(0, len(flat), PRESENCE_CHUNK))
    else:
        pieces = (s.input_ids.numpy() for s in samples if s is not None)
    for ids in pieces:
        ids = np.asarray(ids, dtype=np.int64)
        seen[ids[(ids >= 0) & (ids < vocab_size)]] = True
    return seen
