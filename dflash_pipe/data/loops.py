"""Replies that end in a loop: a greedy target (a small one most of all) that repeats itself until the token
cap.

A reply *ends in a loop* when its last tokens are one unit of ``p`` tokens written again and again: for the
smallest ``p <= LOOP_MAX_PERIOD``, each of its last ``max(LOOP_MIN_REPEATS * p, LOOP_MIN_TOKENS)`` tokens
equals the token ``p`` before it (the unit at least ``LOOP_MIN_REPEATS`` times over, at least
``LOOP_MIN_TOKENS`` tokens in all). ``6 6 6 ...``, ``89 89 89 ...`` and a sentence said three times in a
row all count; a numbered list whose items differ only in their number does not (the repetition must be
exact), nor does a reply shorter than ``LOOP_MIN_TOKENS``.
"""

from __future__ import annotations

from collections.abc import Sequence

LOOP_MAX_PERIOD = 100
"""The longest repeated unit looked for, in tokens (a sentence or two)."""
LOOP_MIN_REPEATS = 3
"""Times the unit must follow itself at the end of the reply."""
LOOP_MIN_TOKENS = 32
"""Tokens the repetition must cover at least (so ``...`` or a short ``ha ha ha`` is no loop)."""


def loop_period(
    tokens: Sequence[int],
    *,
    max_period: int = LOOP_MAX_PERIOD,
    min_repeats: int = LOOP_MIN_REPEATS,
    min_tokens: int = LOOP_MIN_TOKENS,
) -> int | None:
    """The period of the loop ``tokens`` end in (the smallest), None when they end in none (module doc)."""
    tokens = list(tokens)
    n = len(tokens)
    for p in range(1, max_period + 1):
        span = max(min_repeats * p, min_tokens)
        if span > n:
            return None  # spans only grow with p
        if tokens[-1] != tokens[-1 - p]:
            continue  # most periods fail here, at the cost of one comparison
        if tokens[n - span + p :] == tokens[n - span : n - p]:
            return p
    return None


def ends_in_loop(tokens: Sequence[int]) -> bool:
    """Whether a reply ends in a loop (``loop_period`` with the module's bounds)."""
    return loop_period(tokens) is not None
