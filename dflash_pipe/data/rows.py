"""One record batch of a table to tokenized samples: the per-row work of tables, run in-process or in a
worker process, exactly as ``lines.tokenize_piece`` does it for a piece of a JSONL file.

Rows go through the same ``tokenize_object`` and ``keep`` as JSONL lines, so the samples, the drop counts
and the bad-row errors are the same; a bad row is ``FILE:ROW: reason. fix`` with ROW its index in the
dataset (counted from 0, as ``dataset[ROW]`` finds it).
"""

from __future__ import annotations

import threading
from typing import Any

from .config import DataConfig
from .lines import LoadCancelled, Tokenized, add_record
from .tables import rows


def tokenize_rows(
    label: str,
    first_row: int,
    batch: Any,
    cfg: DataConfig,
    tokenizer: Any,
    *,
    cancel: threading.Event | None = None,
) -> Tokenized:
    """Tokenize the rows of ``batch`` (a ``pyarrow.RecordBatch`` whose first row is dataset row
    ``first_row``): truncate, drop short samples, skip bad rows (``cfg.skip_bad_lines``) or raise
    ``DataError("LABEL:ROW: reason. fix")`` on the first."""
    if cancel is not None and cancel.is_set():
        raise LoadCancelled(f"{label}: loading stopped at row {first_row}: the run stopped waiting for it")
    vocab_size = len(tokenizer) if tokenizer is not None else None
    out = Tokenized()
    for row_index, row in enumerate(rows(batch), start=first_row):
        add_record(out, lambda row=row: row, tokenizer, vocab_size, f"{label}:{row_index}", cfg, unit="row")
    return out
