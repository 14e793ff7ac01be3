"""Chat-template rendering and the assistant loss mask.

The rule: a conversation is rendered once with ``tokenizer.apply_chat_template`` (the exact text the target
sees) and tokenized with character offsets. For every assistant message ``i`` we render the prefix
``messages[:i]`` with ``add_generation_prompt=True`` (ending in the assistant header) and ``messages[:i + 1]``
(ending after the assistant turn). The text between the two -- the assistant's content and the template's
end-of-turn marker (``<|im_end|>``, ``<|eot_id|>``, ...), without trailing whitespace -- is the trained span;
the header (``<|im_start|>assistant\\n``), system, user and tool turns are not. A token is trained when its
character span overlaps a trained span. No ``{% generation %}`` markers are needed, so this works for any
fast tokenizer with a chat template (Qwen, Llama, ...).

Templates that render an earlier turn differently once later turns exist (e.g. Qwen3 dropping old reasoning)
are handled by searching the turn's text (or its part after ``</think>``) in the full rendering after the
previous trained span; a turn that cannot be found is a bad line ("template error").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .formats import FormatError


def has_chat_template(tokenizer: Any) -> bool:
    """True if ``tokenizer`` can render conversations."""
    return getattr(tokenizer, "chat_template", None) is not None


def render_conversation(
    tokenizer: Any, messages: list[dict[str, str]], template_kwargs: dict[str, Any] | None = None
) -> tuple[list[int], np.ndarray]:
    """Render and tokenize one conversation; return its ids and a bool mask (True on assistant tokens).
    ``template_kwargs`` go to ``apply_chat_template`` (e.g. ``enable_thinking``)."""
    full, spans = assistant_char_spans(tokenizer, messages, template_kwargs)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)  # [S, 2] char (start, end)
    starts = offsets[:, 0]
    ends = np.maximum(offsets[:, 1], starts + 1)  # zero-width tokens count as one char at their start
    mask = np.zeros(len(ids), dtype=bool)
    for s, e in spans:
        mask |= (starts < e) & (ends > s)
    return ids, mask


def assistant_char_spans(
    tokenizer: Any, messages: list[dict[str, str]], template_kwargs: dict[str, Any] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering of ``messages`` and the character span of every assistant turn in it."""
    kwargs = template_kwargs or {}
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    prompts = [messages[:i] for i in turns if i > 0]
    try:
        full, *completed = _render(
            tokenizer, [messages] + [messages[: i + 1] for i in turns], gen_prompt=False, kwargs=kwargs
        )
        prompted = iter(_render(tokenizer, prompts, gen_prompt=True, kwargs=kwargs) if prompts else [])
    except Exception as e:  # jinja2 errors (raise_exception in templates), KeyError, TypeError, ...
        raise FormatError(
            "template error",
            f"the chat template failed: {type(e).__name__}: {e}",
            "Fix the conversation so that the tokenizer's chat template accepts it (e.g. alternating roles)",
        ) from None
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, done in zip(turns, completed, strict=True):
        content = messages[i]["content"]
        prompt = next(prompted) if i > 0 else None
        if prompt is not None and done.startswith(prompt):
            start = len(prompt)
        else:  # no generation-prompt rendering (first message) or a template that rewrites the prefix
            start = done.rfind(content) if content else len(done.rstrip())
            if start < 0:
                raise _not_found(i)
        end = len(done.rstrip())
        end = max(end, start)
        if full.startswith(done[:end]):
            spans.append((start, end))
            cursor = end
            continue
        # the full rendering differs from the prefix rendering: find the turn's text after the last span
        # (or, for templates that drop old reasoning, the text after its "</think>")
        lo = max(cursor, _common_prefix_len(full, prompt) if prompt is not None else 0)
        text = done[start:end]
        pos = full.find(text, lo)
        if pos < 0 and "</think>" in text:
            text = text.rsplit("</think>", 1)[1].lstrip()
            pos = full.find(text, lo)
        if pos < 0 or not text:
            raise _not_found(i)
        spans.append((pos, pos + len(text)))
        cursor = pos + len(text)
    return full, spans


def render_prompt(tokenizer: Any, messages: list[dict[str, str]], template_kwargs: dict[str, Any]) -> str:
    """The text the target continues to write the next assistant turn (``add_generation_prompt``)."""
    return _render(tokenizer, [messages], gen_prompt=True, kwargs=template_kwargs)[0]


def _render(
    tokenizer: Any, conversations: list[list[dict[str, str]]], *, gen_prompt: bool, kwargs: dict[str, Any]
) -> list[str]:
    out = tokenizer.apply_chat_template(
        conversations, tokenize=False, add_generation_prompt=gen_prompt, **kwargs
    )
    return [out] if isinstance(out, str) else list(out)


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on the longest equal prefix
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _not_found(i: int) -> FormatError:
    return FormatError(
        "template error",
        f"cannot locate assistant message {i} in the chat-template rendering",
        "The chat template rewrites assistant text; pre-tokenize this data with your own loss mask",
    )
