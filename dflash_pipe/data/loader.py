"""Read a JSONL file into tokenized samples: detect the format per line, render, mask, cut, count."""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import DataConfig
from .formats import Conversation, FormatError, PreTokenized, parse_record
from .render import has_chat_template, render_conversation
from .samples import DataError, LoadedData, Sample

AUTO_PROGRESS_BYTES = 4 << 20
"""With ``progress=None``, files at least this big show a progress bar (when stderr is a terminal)."""


def load_samples(cfg: DataConfig, tokenizer: Any, *, progress: bool | None = None) -> LoadedData:
    """Load ``cfg.path``; sample ids are 0..N-1 in file order over the samples kept.

    Bad lines raise ``DataError("FILE:LINE: reason. fix")``, or with ``cfg.skip_bad_lines`` are skipped and
    counted per reason. Samples longer than ``cfg.max_length`` are truncated; samples with fewer than
    ``cfg.min_loss_tokens`` trainable anchor positions (p with loss_mask[p] and loss_mask[p+1]) are dropped.
    ``tokenizer`` (an HF fast tokenizer) is needed for conversation lines and bounds pre-tokenized ids by
    ``len(tokenizer)``; it may be None for pre-tokenized data. ``progress``: show a rich progress bar
    (None: when stderr is a terminal and the file is large).
    """
    path = Path(cfg.path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise DataError(f"{path}: the data file {what}. Pass an existing JSONL file as the data path")
    vocab_size = len(tokenizer) if tokenizer is not None else None
    samples: list[Sample] = []
    reasons: Counter[str] = Counter()
    truncated = dropped_short = 0
    try:
        with open(path, "rb") as f, _progress_bar(path, progress) as advance:
            for lineno, raw in enumerate(f, start=1):
                advance(len(raw))
                if not raw.strip():
                    continue  # blank lines (e.g. a trailing newline) are not samples
                try:
                    ids, mask = _tokenize_line(raw, tokenizer, vocab_size, path, lineno)
                except FormatError as e:
                    if not cfg.skip_bad_lines:
                        raise DataError(f"{path}:{lineno}: {e}") from None
                    reasons[e.kind] += 1
                    continue
                if len(ids) > cfg.max_length:
                    ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
                    truncated += 1
                if int(np.count_nonzero(mask[:-1] & mask[1:])) < cfg.min_loss_tokens:
                    dropped_short += 1
                    continue
                samples.append(
                    Sample(
                        sample_id=len(samples),
                        input_ids=torch.as_tensor(ids, dtype=torch.int64),  # [S]
                        loss_mask=torch.from_numpy(np.ascontiguousarray(mask)),  # [S] bool
                    )
                )
    except OSError as e:
        raise DataError(
            f"{path}: cannot read the data file ({e.strerror or e}). Check its permissions"
        ) from None
    skipped = sum(reasons.values())
    if not samples:
        raise DataError(
            f"{path}: no usable samples ({skipped} bad lines skipped, {dropped_short} samples with fewer than "
            f"min_loss_tokens={cfg.min_loss_tokens} trainable positions). Check that the file has conversations "
            "with assistant replies (or pre-tokenized lines with a non-zero loss_mask)"
        )
    return LoadedData(
        samples=samples,
        skipped_lines=skipped,
        truncated=truncated,
        dropped_short=dropped_short,
        skip_reasons=dict(reasons),
    )


def _tokenize_line(
    raw: bytes, tokenizer: Any, vocab_size: int | None, path: Path, lineno: int
) -> tuple[list[int] | np.ndarray, np.ndarray]:
    """One line -> (ids, bool mask); ``FormatError`` for a bad line, ``DataError`` for a bad tokenizer."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        detail = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise FormatError("not JSON", detail, "Write one JSON object per line (JSONL)") from None
    record = parse_record(obj)
    if isinstance(record, PreTokenized):
        ids = np.asarray(record.input_ids, dtype=np.int64)
        if vocab_size is not None and int(ids.max()) >= vocab_size:
            raise FormatError(
                "ids >= vocab size",
                f"input_ids contains {int(ids.max())} but the tokenizer has {vocab_size} tokens",
                "Pre-tokenize with the target's tokenizer",
            )
        return ids, np.asarray(record.loss_mask, dtype=bool)
    assert isinstance(record, Conversation)
    if tokenizer is None or not has_chat_template(tokenizer):
        what = "no tokenizer was given" if tokenizer is None else "the tokenizer has no chat template"
        raise DataError(
            f"{path}:{lineno}: this line is a conversation, but {what}. Use the target's chat/instruct "
            "tokenizer (one with a chat_template) or pre-tokenize the data (input_ids + loss_mask)"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"{path}:{lineno}: rendering conversations needs a fast tokenizer (character offsets), got "
            f"{type(tokenizer).__name__}. Load it with AutoTokenizer.from_pretrained(..., use_fast=True)"
        )
    return render_conversation(tokenizer, record.messages)


@contextmanager
def _progress_bar(path: Path, show: bool | None) -> Iterator[Any]:
    """Yield ``advance(nbytes)``; draws a rich bar on stderr when asked (or automatically for big files)."""
    total = path.stat().st_size
    if show is None:
        show = total >= AUTO_PROGRESS_BYTES and sys.stderr.isatty()
    if not show:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("loading {task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(path.name, total=total)
        pending = 0

        def advance(n: int) -> None:
            nonlocal pending
            pending += n
            if pending >= 1 << 16:  # update in 64 KiB steps: refreshing per line costs more than parsing
                bar.advance(task, pending)
                pending = 0

        yield advance
        bar.advance(task, pending)
