"""What a regenerated conversation trains, and the regenerated file read back as samples.

One owner for the step from a ``Regenerated`` record to a ``Sample``: the producer places each reply with it
as it arrives, and a peer trainer fed "the rows the run trained" reads the file through it too, so both
train the same ids: the target's own (``token_form.TokenForm``) where the record keeps them, else the
messages rendered with the chat template, cut and checked as any dataset conversation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .config import DataConfig
from .formats import BOOKKEEPING_KEY, FormatError
from .lines import drop_reason, fit_sample
from .regenerated import Regenerated
from .render import render_conversation
from .samples import Sample


def sample_or_reason(record: Regenerated, sample_id: int, tokenizer: Any, cfg: DataConfig) -> Sample | str:
    """The record's training sample, or why it has nothing to train: its first turn's failure (``prompt
    too long``, ``empty reply``, ``template error``) or the loader's drop reason (``data.samples.DROP_*``)."""
    if not record.turns:
        return record.failed.reason if record.failed is not None else "no regenerated turn"
    if record.tokens is not None:
        ids, mask = record.tokens.ids, record.tokens.mask()
    else:
        try:
            ids, mask = render_conversation(tokenizer, record.messages, cfg.chat_template_kwargs)
        except FormatError as exc:
            return exc.kind
    fitted = fit_sample(ids, mask, cfg)
    if fitted is None:
        return drop_reason(mask, cfg)
    return Sample(
        sample_id=sample_id, input_ids=torch.from_numpy(fitted[0]), loss_mask=torch.from_numpy(fitted[1])
    )


def to_sample(record: Regenerated, sample_id: int, tokenizer: Any, cfg: DataConfig) -> Sample | None:
    """``sample_or_reason``'s sample, None when there is nothing to train."""
    made = sample_or_reason(record, sample_id, tokenizer, cfg)
    return made if isinstance(made, Sample) else None


def is_regenerated_file(path: Path) -> bool:
    """True when ``path`` starts with a regenerated file's provenance header."""
    with open(path, "rb") as f:
        first = f.readline(1 << 20)  # a header is small; a one-line JSON array is not read whole
    try:
        header = json.loads(first)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(header, dict) and "regenerated" in (header.get(BOOKKEEPING_KEY) or {})


def regenerated_samples(path: Path, tokenizer: Any, cfg: DataConfig) -> Iterator[Sample]:
    """The samples of a regenerated file's conversations in file order (each sample id its index), those
    with nothing to train left out."""
    with open(path, "rb") as f:
        next(f)  # the header
        for raw in f:
            if raw.strip():
                record = Regenerated.from_line(json.loads(raw))
                if (sample := to_sample(record, record.index, tokenizer, cfg)) is not None:
                    yield sample
