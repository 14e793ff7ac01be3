"""One conversation while the target regenerates it: the messages written so far (the source's, then the
target's replies), where it stands, what its turns counted, and why it stopped. ``result`` is the record
the regenerated file keeps (``data.regenerated.Regenerated``).
"""

from __future__ import annotations

import numpy as np

from dflash_pipe.data.regenerated import Regenerated, TurnFailure
from dflash_pipe.data.token_form import TokenForm


def turn_seed(seed: int, index: int, turn: int) -> int:
    """The sampling seed of one (conversation, turn): independent of batching and of resume."""
    return int(np.random.SeedSequence([seed & 0xFFFFFFFF, index, turn]).generate_state(1, np.uint64)[0] >> 1)


class Conversation:
    """One conversation being regenerated: the source, what is written so far, where it stands."""

    def __init__(self, index: int, messages: list[dict[str, str]]) -> None:
        self.index = index
        self.source = messages
        self.out: list[dict[str, str]] = []
        self.pos = 0
        self.turn = -1
        self.turns = 0
        self.truncated = 0
        self.capped = 0
        self.looped = 0
        self.new_tokens = 0
        self.failed: TurnFailure | None = None
        self.stopped = False
        self.tokens: TokenForm | None = TokenForm()
        """The turns answered so far as the target's ids (None once a prompt did not extend them)."""

    def advance(self) -> bool:
        """Copies the messages up to the next assistant turn; True when there is one to generate."""
        if self.failed is not None or self.stopped:
            return False
        while self.pos < len(self.source) and self.source[self.pos]["role"] != "assistant":
            self.out.append(dict(self.source[self.pos]))
            self.pos += 1
        if self.pos >= len(self.source):
            return False
        self.turn += 1
        return True

    def answer(self, text: str, new_tokens: int, *, truncated: bool) -> None:
        self.out.append({"role": "assistant", "content": text})
        self.pos += 1
        self.turns += 1
        self.new_tokens += new_tokens
        self.truncated += int(truncated)

    def answered_ids(self, prompt: list[int], reply: list[int], end: int | None) -> None:
        """The turn just answered, as the prompt prefilled and the reply decoded (``TokenForm``)."""
        if self.tokens is not None:
            self.tokens = self.tokens.extended(prompt, reply, end)

    def fail(self, reason: str) -> None:
        left = sum(m["role"] == "assistant" for m in self.source[self.pos :])
        self.failed = TurnFailure(turn=self.turn, reason=reason, skipped_turns=left)

    def stop_at_length(self) -> None:
        """The sample reached data.max_length: the later turns are not generated (training would cut them
        off), and are counted as failed with reason "sample full"."""
        self.stopped = True
        left = sum(m["role"] == "assistant" for m in self.source[self.pos :])
        if left:
            self.failed = TurnFailure(turn=self.turn + 1, reason="sample full", skipped_turns=left)

    def result(self) -> Regenerated:
        last = max((i for i, m in enumerate(self.out) if m["role"] == "assistant"), default=-1)
        return Regenerated(
            index=self.index,
            messages=self.out[: last + 1],
            turns=self.turns,
            truncated=self.truncated,
            capped=self.capped,
            looped=self.looped,
            new_tokens=self.new_tokens,
            failed=self.failed,
            tokens=self.tokens if self.turns else None,
        )
