"""The drafter's MASK token: picked for any tokenizer (a named mask token, the tokenizer's own, a free
embedding row, a reserved token, then an unused special token), never one the data contains, and said in
one line. Split from ``config.py``, which records the choice in ``DrafterConfig.extra``."""

from __future__ import annotations

from collections.abc import Container, Iterator
from dataclasses import dataclass
from typing import Any

# The MASK token's name in the serving engines: SGLang looks it up in the target's tokenizer and refuses a
# dflash_config.mask_token_id that differs from its id (sgl-project/sglang python/sglang/srt/speculative/
# dflash_utils.py DEFAULT_DFLASH_MASK_TOKEN; dflash_worker.py DFlashWorker._resolve_mask_token_id).
ENGINE_MASK_TOKEN = "<|MASK|>"
# Token names tried, in order, for the MASK token when none is given (see mask_token_choices): the
# engines' name first, so a tokenizer that has it always gets its id.
_MASK_TOKEN_NAMES = (ENGINE_MASK_TOKEN, "<|mask|>", "<mask>", "[MASK]")
_RESERVED_TOKEN_NAMES = ("<|reserved_special_token_0|>", "<|fim_pad|>", "<|reserved_0|>")


def mask_token_conflict(tokenizer: Any, mask_token_id: int, vocab_size: int) -> str | None:
    """Why SGLang would refuse ``mask_token_id`` with this tokenizer, or None: its vocabulary has
    ENGINE_MASK_TOKEN ("<|MASK|>") under another id, which SGLang checks against dflash_config.mask_token_id."""
    engine_id = tokenizer.get_vocab().get(ENGINE_MASK_TOKEN)
    if engine_id is None or int(engine_id) == int(mask_token_id):
        return None
    engine_id = int(engine_id)
    if engine_id < vocab_size:
        fix = f"pass --mask-token-id {engine_id} (or leave the flag out: the tokenizer's {ENGINE_MASK_TOKEN} is then used)"
    else:
        fix = (
            f"its id is past the target's embedding (vocab_size={vocab_size}), so no mask token id can match "
            f"it: train with a tokenizer that has no {ENGINE_MASK_TOKEN} token or one inside the embedding"
        )
    return (
        f"--mask-token-id {mask_token_id}: the target's tokenizer has {ENGINE_MASK_TOKEN} as id {engine_id}, and "
        f"SGLang refuses a drafter whose dflash_config.mask_token_id ({mask_token_id}) differs from it; {fix}"
    )


class MaskTokenError(ValueError):
    """No token can be the MASK token (or the one given cannot): one line saying to pass --mask-token-id."""


@dataclass(frozen=True, slots=True)
class MaskChoice:
    """The MASK token of a drafter and why it was picked; recorded as ``DrafterConfig.extra["mask_token"]``
    (so in every checkpoint and in an export's ``dflash_pipe`` section)."""

    id: int
    text: str | None
    """The token's text in the tokenizer; None for a free embedding row (no token of the tokenizer)."""
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "text": self.text, "why": self.why}

    def line(self) -> str:
        """One line: id, text and why."""
        text = repr(self.text) if self.text is not None else "(no token: a free embedding row)"
        return f"mask token: id {self.id} {text}, {self.why}"


MASK_TOKEN_KEY = "mask_token"
"""``DrafterConfig.extra`` key of the ``MaskChoice`` as a dict."""


def mask_line(cfg: Any) -> str:
    """The MASK token of a ``DrafterConfig`` in one line (id, text, why), from its recorded choice or its id
    alone (typed Any: this module sits below the config that records it)."""
    recorded = cfg.extra.get(MASK_TOKEN_KEY)
    if isinstance(recorded, dict) and recorded.get("id") == cfg.mask_token_id:
        return MaskChoice(cfg.mask_token_id, recorded.get("text"), str(recorded.get("why"))).line()
    return f"mask token: id {cfg.mask_token_id}"


def given_mask_token(tokenizer: Any, mask_token_id: int) -> MaskChoice:
    """The choice an explicit ``--mask-token-id`` makes."""
    text = _token_text(tokenizer, int(mask_token_id)) if tokenizer is not None else None
    return MaskChoice(int(mask_token_id), text, "given by --mask-token-id")


def _token_text(tokenizer: Any, token_id: int) -> str | None:
    """The token's text in the tokenizer's vocabulary, None for an id it does not have."""
    return next((text for text, i in tokenizer.get_vocab().items() if i == token_id), None)


def mask_token_choices(tokenizer: Any, vocab_size: int) -> Iterator[MaskChoice]:
    """Every candidate MASK token of this tokenizer, best first (``resolve_mask_token`` takes the first the
    data does not use).

    Order: a vocabulary token named "<|MASK|>" (the serving engines' name, ENGINE_MASK_TOKEN; then
    "<|mask|>", "<mask>", "[MASK]"); the tokenizer's `mask_token_id`; then `len(tokenizer)` when that is
    still a row of the target's embedding (this is the id SpecForge gets from
    `add_special_tokens({"mask_token": "<|MASK|>"})`, e.g. 151669 for Qwen3 as in the published z-lab DFlash
    configs, an embedding row no text ever produces); then a reserved special token
    ("<|reserved_special_token_0|>" for Llama-3, "<|fim_pad|>" for Qwen); then the unused special tokens,
    highest id first: added special tokens that are not bos/eos/pad/unk and that the chat template does not
    write (SmolLM2's code tokens, ids 3-16: "<empty_output>", 16, first).
    """
    vocab = tokenizer.get_vocab()
    for name in _MASK_TOKEN_NAMES:
        if name in vocab and vocab[name] < vocab_size:
            yield MaskChoice(int(vocab[name]), name, f"the tokenizer's {name} token")
    tok_mask = getattr(tokenizer, "mask_token_id", None)
    if isinstance(tok_mask, int) and 0 <= tok_mask < vocab_size:
        yield MaskChoice(tok_mask, _token_text(tokenizer, tok_mask), "the tokenizer's mask token")
    if len(tokenizer) < vocab_size:
        yield MaskChoice(
            len(tokenizer),
            None,
            f"the first embedding row past the tokenizer (len(tokenizer)={len(tokenizer)} < "
            f"vocab_size={vocab_size}): no text produces it",
        )
    for name in _RESERVED_TOKEN_NAMES:
        if name in vocab and vocab[name] < vocab_size:
            yield MaskChoice(int(vocab[name]), name, "a reserved special token of the tokenizer")
    for token_id, text in unused_special_tokens(tokenizer, vocab_size):
        yield MaskChoice(
            token_id,
            text,
            "an unused special token (not bos/eos/pad/unk, not written by the chat template; the tokenizer "
            "has no mask or reserved token and no free embedding row)",
        )


def unused_special_tokens(tokenizer: Any, vocab_size: int) -> list[tuple[int, str]]:
    """(id, text) of the tokenizer's added special tokens that are not bos/eos/pad/unk and do not appear
    in its chat template's rendering of a sample conversation, highest id first."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    roles = {
        getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk", "cls", "sep")
    }
    written = _template_token_ids(tokenizer)
    out = []
    for token_id, token in decoder.items():
        if not getattr(token, "special", False) or not 0 <= int(token_id) < vocab_size:
            continue
        if int(token_id) in roles or int(token_id) in written:
            continue
        out.append((int(token_id), str(token.content if hasattr(token, "content") else token)))
    return sorted(out, reverse=True)


_SAMPLE_CONVERSATIONS = (
    [
        {"role": "user", "content": "Hello, how are you?"},
        {"role": "assistant", "content": "Fine, thanks."},
        {"role": "user", "content": "Write a short poem."},
    ],
    [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ],
)


def _template_token_ids(tokenizer: Any) -> set[int]:
    """The token ids the chat template writes around sample conversations (its default system prompt, its
    role markers, its end-of-turn tokens); empty without a template."""
    ids: set[int] = set()
    if not getattr(tokenizer, "chat_template", None):
        return ids
    for messages in _SAMPLE_CONVERSATIONS:
        for prompt in (True, False):
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            except (
                Exception
            ):  # a template that refuses this shape (e.g. no system role): the other shapes count
                continue
            ids.update(int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids


def resolve_mask_token(tokenizer: Any, vocab_size: int, *, used: Container[int] = ()) -> MaskChoice:
    """The first of ``mask_token_choices`` whose id is not in ``used`` (the token ids the training data
    contains: a MASK slot must never look like text). None left -> ``MaskTokenError``."""
    for choice in mask_token_choices(tokenizer, vocab_size):
        if choice.id not in used:
            return choice
    data = " the data does not use, and" if used else ""
    raise MaskTokenError(
        f"mask token: the tokenizer has no mask, reserved or unused special token{data} no free embedding row "
        f"(len(tokenizer)={len(tokenizer)}, vocab_size={vocab_size}); pass --mask-token-id with an id the "
        "training data never contains"
    )


def resolve_mask_token_id(tokenizer: Any, vocab_size: int) -> int:
    """The id of ``resolve_mask_token``'s choice."""
    return resolve_mask_token(tokenizer, vocab_size).id
