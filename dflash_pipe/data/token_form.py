"""A regenerated conversation as the target's own token ids: what the sample trains, built without rendering
and tokenizing the replies' text again.

Turn by turn the regeneration prefills a prompt (the chat template's rendering of the conversation so far,
tokenized) and decodes a reply. When every turn's prompt begins with the previous prompt, reply and
end-of-turn token, the conversation *is* the last prompt followed by the last reply: its ids are exactly
what the target read and wrote, and the trained spans are the replies (each with the end-of-turn token the
target wrote; a reply cut at the token limit has none, and none is trained after it). A template that
rewrites an earlier turn (Qwen3 drops old reasoning) or a reply whose text tokenizes differently breaks that
chain: the conversation then has no token form and its sample is rendered from the text, as any dataset
conversation is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class TokenForm:
    """The ids of a conversation so far and the (start, end) spans of its replies."""

    ids: list[int] = field(default_factory=list)
    trained: list[tuple[int, int]] = field(default_factory=list)

    def extended(self, prompt: list[int], reply: list[int], end: int | None) -> TokenForm | None:
        """This form with one more turn, or None when ``prompt`` does not begin with everything so far."""
        if prompt[: len(self.ids)] != self.ids:
            return None
        turn = reply + ([end] if end is not None else [])
        start = len(prompt)
        return TokenForm(list(prompt) + turn, [*self.trained, (start, start + len(turn))])

    def mask(self) -> np.ndarray:
        """A bool per id: True on the replies' tokens."""
        mask = np.zeros(len(self.ids), dtype=bool)
        for start, end in self.trained:
            mask[start:end] = True
        return mask

    def to_json(self) -> dict[str, Any]:
        return {"ids": self.ids, "trained": [list(span) for span in self.trained]}

    @classmethod
    def from_json(cls, obj: Any) -> TokenForm | None:
        """The form a file line holds; None for a line without one (or not of this shape)."""
        if not isinstance(obj, dict) or not isinstance(obj.get("ids"), list):
            return None
        ids, spans = obj["ids"], obj.get("trained")
        if not all(isinstance(i, int) for i in ids) or not isinstance(spans, list):
            return None
        try:
            trained = [(int(s), int(e)) for s, e in spans]
        except (TypeError, ValueError):  # a span that is not two numbers
            return None
        if any(not 0 <= s < e <= len(ids) for s, e in trained):
            return None
        return cls(ids, trained)
