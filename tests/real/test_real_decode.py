"""The slot engine decodes the real target as HF ``generate`` does: greedy replies to real ShareGPT prompts,
token for token, on fewer slots than prompts (a freed slot takes the next prompt), and regeneration
(``TurnGenerator.regenerate``, the path ``--responses target`` runs) writes those replies as the turns."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.data.config import RegenConfig
from dflash_pipe.data.render import render_prompt
from dflash_pipe.target.decode import TurnRequest
from dflash_pipe.target.generate import TurnGenerator

pytestmark = pytest.mark.real

MAX_NEW = 28
SLOTS = 3


class _Prompt:
    def __init__(self, request: TurnRequest) -> None:
        self.request: TurnRequest | None = request
        self.reply: list[int] | None = None
        self.end: int | None = None

    def next_request(self) -> TurnRequest | None:
        request, self.request = self.request, None
        return request

    def take(self, tokens: list[int], end: int | None) -> None:
        self.reply, self.end = tokens, end


def _hf_reply(model, prompt: list[int], end_ids: list[int]) -> list[int]:
    """HF ``generate``, greedy, one prompt alone; the reply without its end-of-turn token."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=end_ids,
            pad_token_id=end_ids[0],
        )[0, len(prompt) :].tolist()
    return out[:-1] if out and out[-1] in end_ids else out


@pytest.mark.slow
def test_slot_engine_replies_equal_hf_generate(hf_model, tokenizer, sharegpt_prompts):
    """About 45 s in a full suite: SmolLM2-135M decodes the ShareGPT prompts twice, with HF's own ``generate``
    one prompt at a time (the reference) and with the slot engine. The claim is about the real trained model,
    so the model is not shrunk."""
    settings = RegenConfig(max_new_tokens=MAX_NEW, batch_size=SLOTS)
    gen = TurnGenerator(hf_model, tokenizer, settings, device="cpu", max_length=512)
    engine = gen.engine()
    assert engine is not None, "the slot engine refused the real target"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in gen.end_ids

    conversations = [[{"role": "user", "content": text}] for text in sharegpt_prompts]
    prompts = [
        tokenizer(render_prompt(tokenizer, messages, {}), add_special_tokens=False)["input_ids"]
        for messages in conversations
    ]
    sessions = [_Prompt(TurnRequest(p, MAX_NEW)) for p in prompts]
    engine.run(sessions)
    want = [_hf_reply(hf_model, p, gen.end_ids) for p in prompts]
    for session, reply in zip(sessions, want, strict=True):
        assert session.reply == reply
        assert (session.end is not None) == (len(reply) < MAX_NEW)
    assert sum(len(r) for r in want) >= MAX_NEW * len(want) // 2, want  # real replies, not empty ones

    # the same turns through regeneration: each conversation's assistant turn is the decoded HF reply
    dataset = [[*m, {"role": "assistant", "content": "DATASET REPLY"}] for m in conversations]
    got = gen.regenerate(list(enumerate(dataset)))
    for result, messages, reply in zip(got, conversations, want, strict=True):
        assert result.messages == [*messages, {"role": "assistant", "content": tokenizer.decode(reply)}]
