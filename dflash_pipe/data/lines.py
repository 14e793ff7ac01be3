"""One piece of a JSONL file to tokenized samples: the per-line work, run in-process or in a worker process.

A piece is a byte range that starts and ends at a line boundary, with the number of its first line, so a
worker that tokenizes it reports bad lines as ``FILE:LINE`` exactly as a whole-file pass does. What a piece
gives is plain numpy arrays and counters (cheap to pickle); the loader merges pieces in file order.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from .config import DataConfig
from .formats import (
    BOOKKEEPING_KEY,
    Conversation,
    FormatError,
    LeftOut,
    PreTokenized,
    is_bookkeeping,
    parse_record,
)
from .render import has_chat_template, render_conversation
from .samples import (
    DROP_EMPTY_REPLIES,
    DROP_FEW_TOKENS,
    DROP_NOT_REGENERATED,
    DROP_TOO_LONG,
    DataError,
)


class LoadCancelled(DataError):
    """Loading stopped because the run stopped waiting for the data (``DataFuture.close``)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes ``[start, end)`` of the data file (``end`` None: to the end of the file), starting at line
    ``first_line`` (1-based)."""

    start: int
    end: int | None
    first_line: int


@dataclass(slots=True)
class Tokenized:
    """The samples a piece kept, in file order, and what it left out."""

    samples: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    """(input_ids int64 [S], loss_mask bool [S]) per kept sample."""
    reasons: Counter[str] = field(default_factory=Counter)
    """Skipped bad lines by reason."""
    truncated: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    """Samples left out by reason (``samples.DROP_*``)."""
    shortest_cut: int | None = None
    """The token count of the shortest sample dropped because ``max_length`` cut it (``DROP_TOO_LONG``)."""


def tokenize_piece(
    path: Path,
    piece: Piece,
    cfg: DataConfig,
    tokenizer: Any,
    *,
    advance: Callable[[int], None] = lambda n: None,
    cancel: threading.Event | None = None,
) -> Tokenized:
    """Tokenize the lines of ``piece``: truncate to ``cfg.max_length``, drop samples under
    ``cfg.min_loss_tokens`` anchor positions, and skip bad lines (``cfg.skip_bad_lines``) or raise
    ``DataError("FILE:LINE: reason. fix")`` on the first. ``advance(nbytes)`` is called per line."""
    vocab_size = len(tokenizer) if tokenizer is not None else None
    out = Tokenized()
    with open(path, "rb") as f:
        f.seek(piece.start)
        left = piece.end - piece.start if piece.end is not None else None
        for lineno, raw in enumerate(f, start=piece.first_line):
            if left is not None:
                if left <= 0:
                    break
                left -= len(raw)
            advance(len(raw))
            if cancel is not None and cancel.is_set():
                raise LoadCancelled(
                    f"{path}: loading stopped at line {lineno}: the run stopped waiting for it"
                )
            if not raw.strip():
                continue  # blank lines (e.g. a trailing newline) are not samples
            add_record(out, partial(decode_line, raw), tokenizer, vocab_size, f"{path}:{lineno}", cfg)
    return out


def add_record(
    out: Tokenized,
    load: Callable[[], Any],
    tokenizer: Any,
    vocab_size: int | None,
    where: str,
    cfg: DataConfig,
    unit: str = "line",
) -> None:
    """One record (``load()``: a JSONL line's object, a JSON array's record or a table's row) tokenized into
    ``out``: kept, dropped by reason (a conversation with nothing to train among them), or a bad record
    skipped (``cfg.skip_bad_lines``) or raised as ``DataError("WHERE: reason")``."""
    try:
        line = tokenize_object(load(), tokenizer, vocab_size, where, cfg.chat_template_kwargs, unit=unit)
    except LeftOut as e:
        out.dropped[e.reason] += 1
        return
    except FormatError as e:
        if not cfg.skip_bad_lines:
            raise DataError(f"{where}: {e}") from None
        out.reasons[e.kind] += 1
        return
    keep(out, line, cfg)


TokenizedLine = tuple[list[int] | np.ndarray, np.ndarray, bool] | object | None
"""What ``tokenize_object`` makes of one record: (ids, bool mask, every assistant turn empty), None for a
regenerated file's provenance header, or ``NOT_REGENERATED``."""


def keep(out: Tokenized, line: TokenizedLine, cfg: DataConfig) -> None:
    """Adds what ``tokenize_object`` made of one line or row to ``out``: a sample cut to ``cfg.max_length``,
    or a count of why it is left out."""
    if line is None:
        return  # a regenerated file's provenance header
    if line is NOT_REGENERATED:
        out.dropped[DROP_NOT_REGENERATED] += 1
        return
    assert isinstance(line, tuple)
    ids, mask, empty_replies = line
    if len(ids) > cfg.max_length:
        out.truncated += 1
    fitted = fit_sample(ids, mask, cfg)
    if fitted is None:
        why = drop_reason(mask, cfg, empty_replies=empty_replies)
        out.dropped[why] += 1
        if why == DROP_TOO_LONG:
            out.shortest_cut = min(len(ids), out.shortest_cut or len(ids))
        return
    out.samples.append(fitted)


NOT_REGENERATED = object()
"""``tokenize_object``'s answer for a regenerated file's record of a conversation it could not regenerate."""


def drop_reason(mask: np.ndarray, cfg: DataConfig, *, empty_replies: bool = False) -> str:
    """Why a sample ``fit_sample`` refused is left out: its assistant turns are all empty, it would have
    enough trainable positions but ``max_length`` cuts them off, or it has too few at any length."""
    if empty_replies:
        return DROP_EMPTY_REPLIES
    if len(mask) > cfg.max_length and _anchors(mask) >= cfg.min_loss_tokens:
        return DROP_TOO_LONG
    return DROP_FEW_TOKENS


def _anchors(mask: np.ndarray) -> int:
    mask = np.asarray(mask, dtype=bool)
    return int(np.count_nonzero(mask[:-1] & mask[1:]))


def fit_sample(
    ids: list[int] | np.ndarray, mask: np.ndarray, cfg: DataConfig
) -> tuple[np.ndarray, np.ndarray] | None:
    """A sample cut to ``cfg.max_length``, or None when it keeps fewer than ``cfg.min_loss_tokens`` trainable
    anchor positions (p with mask[p] and mask[p+1])."""
    ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
    if _anchors(mask) < cfg.min_loss_tokens:
        return None
    return np.asarray(ids, dtype=np.int64), np.ascontiguousarray(mask, dtype=bool)


def decode_line(raw: bytes) -> Any:
    """One JSONL line as its JSON value; ``FormatError("not JSON")`` when it is none."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        detail = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise FormatError("not JSON", detail, "Write one JSON object per line (JSONL)") from None


def tokenize_object(
    obj: Any,
    tokenizer: Any,
    vocab_size: int | None,
    where: str,
    template_kwargs: dict[str, Any],
    *,
    unit: str = "line",
) -> TokenizedLine:
    """One decoded JSON line, array record or dataset row (``where``: ``FILE:LINE``, ``FILE:[N]`` or
    ``FILE:ROW``, ``unit`` "line", "record" or "row", for errors) -> a ``TokenizedLine``; ``LeftOut`` for a
    conversation with nothing to train, ``FormatError`` for a bad record, ``DataError`` for a bad
    tokenizer (it would fail every conversation, so it stops the load even with ``skip_bad_lines``)."""
    if is_bookkeeping(obj):
        info = obj[BOOKKEEPING_KEY]
        return NOT_REGENERATED if isinstance(info, dict) and "failed" in info else None
    record = parse_record(obj)
    if isinstance(record, PreTokenized):
        ids = np.asarray(record.input_ids, dtype=np.int64)
        if vocab_size is not None and int(ids.max()) >= vocab_size:
            raise FormatError(
                "ids >= vocab size",
                f"input_ids contains {int(ids.max())} but the tokenizer has {vocab_size} tokens",
                "Pre-tokenize with the target's tokenizer",
            )
        return ids, np.asarray(record.loss_mask, dtype=bool), False
    assert isinstance(record, Conversation)
    if tokenizer is None or not has_chat_template(tokenizer):
        what = "no tokenizer was given" if tokenizer is None else "the tokenizer has no chat template"
        raise DataError(
            f"{where}: this {unit} is a conversation, but {what}. Use the target's chat/instruct "
            "tokenizer (one with a chat_template) or pre-tokenize the data (input_ids + loss_mask)"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"{where}: rendering conversations needs a fast tokenizer (character offsets), got "
            f"{type(tokenizer).__name__}. Load it with AutoTokenizer.from_pretrained(..., use_fast=True)"
        )
    ids, mask = render_conversation(tokenizer, record.messages, template_kwargs)
    empty = all(not m["content"].strip() for m in record.messages if m["role"] == "assistant")
    return ids, mask, empty
