"""The conversations of the source data, in order, ready to regenerate: what ``--responses target`` and
``dflash-pipe regenerate`` hand the target, by index (the sample ids of the regenerated run).

Any source ``sources.resolve_source`` accepts: JSONL lines, JSON array records or table rows, parsed by the
same ``formats.parse_record`` and with the same ``FILE:LINE`` / ``FILE:[N]`` / ``FILE:ROW`` errors as the
training loader. Assistant turns before the first user turn (39% of ShareGPT V3's records start with one:
the reply to a prompt that went to the record before) have no prompt to regenerate from: they are left
out, and a note counts them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, MutableSequence, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .arrays import ArrayRecords, where
from .arrays import load as load_record
from .config import DataConfig
from .formats import (
    LEFT_OUT_NO_ASSISTANT,
    Conversation,
    FormatError,
    LeftOut,
    PreTokenized,
    is_bookkeeping,
    parse_record,
)
from .lines import decode_line
from .resolved import JsonArraySource, Source, TableSource
from .samples import DataError
from .sources import resolve_source
from .tables import table_rows


@dataclass(slots=True)
class SourceConversations:
    """The conversations of a data file, in file order, ready to regenerate."""

    path: Path
    conversations: Sequence[list[dict[str, str]]]
    """In memory, or on disk (``spill.SpilledConversations``) when loaded with a ``spill_dir``."""
    skipped_lines: int = 0
    skip_reasons: dict[str, int] = field(default_factory=dict)
    drop_reasons: dict[str, int] = field(default_factory=dict)
    """Conversations with nothing to train (``formats.LEFT_OUT_*``), by reason."""
    notes: list[str] = field(default_factory=list)
    """How the data was read (a JSON array cut short) and what was trimmed (leading assistant turns)."""

    def assistant_turns(self, indexes: Iterable[int] | None = None) -> int:
        picked = self.conversations if indexes is None else (self.conversations[i] for i in indexes)
        return sum(sum(m["role"] == "assistant" for m in c) for c in picked)


def load_conversations(cfg: DataConfig, spill_dir: Path | None = None) -> SourceConversations:
    """The conversations of ``cfg.path`` (messages or ShareGPT lines, or rows of a table; a regenerated
    file's bookkeeping lines are skipped), indexed in file (row) order over those kept. Pre-tokenized
    records have no turns to regenerate: a ``DataError`` naming the line. Bad lines raise ``DataError`` or,
    with ``cfg.skip_bad_lines``, are counted per reason. Regeneration hands them out by index, in
    length-sorted windows: they are held in memory, or with ``spill_dir`` in an anonymous file there (a run
    passes its run dir: a big set then costs 8 bytes a conversation of memory)."""
    from .spill import SpilledConversations

    source = resolve_source(cfg.path)
    kept: MutableSequence[list[dict[str, str]]] | SpilledConversations = (
        [] if spill_dir is None else SpilledConversations(spill_dir)
    )
    out = SourceConversations(path=Path(source.label), conversations=kept)
    reasons: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    trimmed = 0
    for at, unit, load in _records(source, out.notes):
        try:
            obj = load()
            if is_bookkeeping(obj):
                continue
            record = parse_record(obj)
        except LeftOut as e:
            dropped[e.reason] += 1
            continue
        except FormatError as e:
            if not cfg.skip_bad_lines:
                raise DataError(f"{at}: {e}") from None
            reasons[e.kind] += 1
            continue
        if isinstance(record, PreTokenized):
            raise DataError(
                f"{at}: this {unit} is pre-tokenized (input_ids + loss_mask), so it has no turns "
                "for the target to regenerate. Use --responses target with conversations (messages or "
                "ShareGPT format), or train this data as it is with --responses dataset"
            )
        assert isinstance(record, Conversation)
        messages = without_leading_replies(record.messages)
        if len(messages) < len(record.messages):
            trimmed += 1
            if not any(m["role"] == "assistant" for m in messages):
                dropped[LEFT_OUT_NO_ASSISTANT] += 1
                continue
        kept.append(messages)
    out.skipped_lines = sum(reasons.values())
    out.skip_reasons = dict(reasons)
    out.drop_reasons = dict(dropped)
    if trimmed:
        out.notes.append(
            f"{trimmed} conversations of {source.label} start with an assistant turn: with no prompt to "
            "answer, regeneration leaves it out"
        )
    if not out.conversations:
        left_out = ", ".join(f"{n} {why}" for why, n in sorted(dropped.items())) or "none"
        raise DataError(
            f"{source.label}: no conversations to regenerate ({out.skipped_lines} bad lines skipped; left "
            f"out: {left_out}). Check that the data has conversations with assistant replies"
        )
    return out


def without_leading_replies(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """``messages`` without the assistant turns before the first user turn (system turns stay)."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    if not any(m["role"] == "assistant" for m in messages[:first_user]):
        return messages
    return [m for i, m in enumerate(messages) if i >= first_user or m["role"] != "assistant"]


def _records(source: Source, notes: list[str]) -> Iterator[tuple[str, str, Callable[[], Any]]]:
    """``(FILE:LINE, FILE:[N] or FILE:ROW, "line", "record" or "row", load)`` for every record of
    ``source``: ``load()`` is its value or raises its ``FormatError``. How a JSON array was read (cut short)
    goes into ``notes``."""
    if isinstance(source, TableSource):
        for index, row in table_rows(source):
            yield f"{source.label}:{index}", "row", lambda row=row: row
        return
    try:
        if isinstance(source, JsonArraySource):
            records = ArrayRecords(source.path, source.label)
            for index, _, item in records:
                yield where(source.label, index), "record", lambda item=item: load_record(item)
            notes.extend([records.note] if records.note else [])
            return
        with open(source.path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if raw.strip():
                    yield f"{source.path}:{lineno}", "line", lambda raw=raw: decode_line(raw)
    except OSError as e:
        raise DataError(
            f"{source.path}: cannot read the data file ({e.strerror or e}). Check its permissions"
        ) from None


def check_prompts_fit(source: SourceConversations, tokenizer: Any, cfg: DataConfig) -> None:
    """Before anything is generated: ``DataError`` (one line: the shortest prompt and the length to ask for)
    when no conversation's first prompt leaves room under ``cfg.max_length`` for a reply of
    ``cfg.min_loss_tokens + 1`` tokens, so the target would regenerate the whole file for nothing to train.
    Returns at the first conversation that fits (the usual case: one prompt rendered)."""
    from .loader import no_fit_message
    from .render import render_prompt

    room = cfg.min_loss_tokens + 1
    shortest: int | None = None
    for messages in source.conversations:
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        if first == 0:
            return  # no prompt before the reply
        try:
            text = render_prompt(tokenizer, messages[:first], cfg.chat_template_kwargs)
        except Exception:  # a template error: regeneration reports it per conversation
            continue
        length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if length + room <= cfg.max_length:
            return
        shortest = length if shortest is None else min(shortest, length)
    if shortest is not None:
        raise DataError(
            no_fit_message(source.path, cfg, shortest, need=shortest + room, what="first prompt")
            + f" (a prompt needs room for a reply of {room} tokens to train)"
        )
