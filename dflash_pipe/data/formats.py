"""Message-format parsing: turn one decoded JSON line into a conversation or a pre-tokenized sample.

Formats, detected per line by their top-level key:

- messages:      ``{"messages": [{"role": "user", "content": "..."}, ...]}`` (roles system/user/assistant/tool)
- ShareGPT:      ``{"conversations": [{"from": "human", "value": "..."}, ...]}``
- pre-tokenized: ``{"input_ids": [1, 2, ...], "loss_mask": [0, 1, ...]}`` (same length; mask 0/1 or bool)

ShareGPT turns are mapped to messages, so both formats give identical samples for the same conversation.
A well-formed conversation with nothing to train (no messages, no assistant turn, a role that maps to none)
raises ``LeftOut``, not ``FormatError``: it is left out and counted by reason, never a bad line.
A file written by regeneration (``dflash_pipe.data.regenerated``) is in the messages format plus lines of its
own bookkeeping (key ``BOOKKEEPING_KEY``, no ``messages``: the provenance header, conversations it could not
regenerate), which every reader skips.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
"""Roles accepted in the messages format."""

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
"""ShareGPT ``from`` values and the message role each becomes."""


BOOKKEEPING_KEY = "dflash_pipe"
"""A line with this key and no ``messages`` is a regenerated file's bookkeeping, not a sample."""


def is_bookkeeping(obj: Any) -> bool:
    """True for a regenerated file's provenance header or the record of a conversation it left out."""
    return isinstance(obj, dict) and BOOKKEEPING_KEY in obj and "messages" not in obj


LEFT_OUT_EMPTY = "empty conversation"
"""A conversation without messages (ShareGPT V3 has some): nothing to train."""
LEFT_OUT_NO_ASSISTANT = "no assistant turn"
"""A conversation without an assistant message: nothing to train."""
LEFT_OUT_UNKNOWN_ROLE = "unknown role"
"""A conversation with a role (a ShareGPT ``from``) that maps to none of ``ROLES``."""


class LeftOut(Exception):
    """A well-formed conversation with nothing to train: the loaders count it by ``reason`` (one of the
    ``LEFT_OUT_*``) with the samples left out, whatever ``skip_bad_lines`` says."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class FormatError(Exception):
    """A line that does not fit any format; the loader adds file and line to make it a ``DataError``."""

    def __init__(self, kind: str, detail: str, fix: str) -> None:
        super().__init__(f"{kind}: {detail}. {fix}")
        self.kind = kind  # short reason, the key of LoadedData.skip_reasons
        self.detail = detail
        self.fix = fix


@dataclass(frozen=True, slots=True)
class Conversation:
    """Chat messages as ``{"role", "content"}`` dicts, ready for ``apply_chat_template``."""

    messages: list[dict[str, str]]


@dataclass(frozen=True, slots=True)
class PreTokenized:
    """Token ids and their 0/1 loss mask, used as they are."""

    input_ids: list[int]
    loss_mask: list[int]


Record = Conversation | PreTokenized


def parse_record(obj: Any) -> Record:
    """Detect the format of one decoded JSON line and validate it; raise ``FormatError`` if it fits none, or
    ``LeftOut`` for a conversation with nothing to train."""
    if not isinstance(obj, dict):
        raise FormatError(
            "wrong schema",
            f"expected a JSON object, got {type(obj).__name__}",
            'Write one object per line: {"messages": [...]}, {"conversations": [...]} or {"input_ids": [...], "loss_mask": [...]}',
        )
    if "messages" in obj:
        return _parse_messages(obj["messages"])
    if "conversations" in obj:
        return _parse_sharegpt(obj["conversations"])
    if "input_ids" in obj:
        return _parse_pretokenized(obj)
    keys = ", ".join(sorted(map(str, obj))[:8]) or "none"
    raise FormatError(
        "wrong schema",
        f"no 'messages', 'conversations' or 'input_ids' key (keys: {keys})",
        "Use the messages, ShareGPT or pre-tokenized format (see dflash_pipe.data.formats)",
    )


def _parse_messages(raw: Any) -> Conversation:
    if not isinstance(raw, list):
        raise FormatError(
            "wrong schema", "'messages' is not a list", 'Write "messages": [{"role": ..., "content": ...}]'
        )
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise FormatError(
                "wrong schema",
                f"message {i} is not an object with 'role' and 'content'",
                'Write each message as {"role": "user"|"assistant"|..., "content": "..."}',
            )
        role = m["role"]
        if role not in ROLES:
            raise LeftOut(LEFT_OUT_UNKNOWN_ROLE)
        messages.append({"role": role, "content": _content(m["content"], i)})
    return _check_conversation(messages)


def _parse_sharegpt(raw: Any) -> Conversation:
    if not isinstance(raw, list):
        raise FormatError(
            "wrong schema",
            "'conversations' is not a list",
            'Write "conversations": [{"from": ..., "value": ...}]',
        )
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or "from" not in m or "value" not in m:
            raise FormatError(
                "wrong schema",
                f"turn {i} is not an object with 'from' and 'value'",
                'Write each turn as {"from": "human"|"gpt"|"system", "value": "..."}',
            )
        role = SHAREGPT_ROLES.get(m["from"]) if isinstance(m["from"], str) else None
        if role is None:
            raise LeftOut(LEFT_OUT_UNKNOWN_ROLE)
        messages.append({"role": role, "content": _content(m["value"], i)})
    return _check_conversation(messages)


def _content(value: Any, i: int) -> str:
    if not isinstance(value, str):
        raise FormatError(
            "wrong schema",
            f"message {i} content is {type(value).__name__}, not a string",
            "Write content as a string",
        )
    return value


def _check_conversation(messages: list[dict[str, str]]) -> Conversation:
    if not messages:
        raise LeftOut(LEFT_OUT_EMPTY)
    if not any(m["role"] == "assistant" for m in messages):
        raise LeftOut(LEFT_OUT_NO_ASSISTANT)
    return Conversation(messages)


def _parse_pretokenized(obj: dict) -> PreTokenized:
    ids, mask = obj["input_ids"], obj.get("loss_mask")
    if mask is None:
        raise FormatError(
            "wrong schema", "'input_ids' without 'loss_mask'", "Add a 0/1 'loss_mask' list of the same length"
        )
    if not isinstance(ids, list) or not isinstance(mask, list):
        raise FormatError(
            "wrong schema", "'input_ids' and 'loss_mask' must be lists", "Write both as JSON lists"
        )
    if len(ids) != len(mask):
        raise FormatError(
            "length mismatch",
            f"input_ids has {len(ids)} tokens but loss_mask has {len(mask)}",
            "Give loss_mask exactly one 0/1 entry per token",
        )
    if not ids:
        raise FormatError("empty input_ids", "input_ids is empty", "Remove the line or add tokens")
    # bool is an int subclass: reject it in ids, accept it in the mask
    if not all(type(t) is int for t in ids):
        bad = next(t for t in ids if type(t) is not int)
        raise FormatError("non-int ids", f"input_ids contains {bad!r}", "Write token ids as JSON integers")
    if min(ids) < 0:
        raise FormatError("negative ids", f"input_ids contains {min(ids)}", "Token ids must be >= 0")
    if not all(m in (0, 1) and type(m) in (int, bool) for m in mask):
        bad = next(m for m in mask if not (m in (0, 1) and type(m) in (int, bool)))
        raise FormatError("bad loss_mask", f"loss_mask contains {bad!r}", "Write loss_mask as 0/1 integers")
    return PreTokenized([int(t) for t in ids], [int(m) for m in mask])
