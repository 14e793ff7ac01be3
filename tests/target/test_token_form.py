"""A regenerated conversation's sample is the target's own ids (``TokenForm``), built without rendering and
tokenizing the replies again: checked against the same conversation rendered by the tokenizer's chat
template and tokenized (the form every dataset conversation trains), and refused where the template
rewrites an earlier turn or a reply's text tokenizes otherwise."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoModelForCausalLM

from dflash_pipe.data import DataConfig, demo_tokenizer
from dflash_pipe.data.config import RegenConfig
from dflash_pipe.data.regen_samples import sample_or_reason
from dflash_pipe.data.regenerated import Regenerated
from dflash_pipe.data.render import render_conversation, render_prompt
from dflash_pipe.data.token_form import TokenForm
from dflash_pipe.target.generate import TurnGenerator
from dflash_pipe.target.plain_decode import Reply
from tests.target.conversations import CONVERSATIONS
from tests.tiny_models import tiny_qwen3_config

DROPS_OLD_REASONING = (  # as Qwen3's template: an earlier assistant turn loses what precedes </think>
    "{%- for message in messages %}{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


_MODEL = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=1035, max_position_embeddings=512))
"""Never run: the scripted decoder answers for it (the generator reads its generation config)."""


@pytest.fixture(scope="module")
def tok():
    return demo_tokenizer()


class _Scripted:
    """Stands in for the target's decoding: the reply to a prompt is its script's ids and end token (or none:
    cut at the limit). The generator renders and tokenizes the prompts itself, as with a real target."""

    def __init__(self, tok, replies: dict[str, tuple[list[int], int | None]]) -> None:
        self.tok, self.replies = tok, replies
        self.prompts: list[list[int]] = []

    def generate(self, prompts, max_new, seeds=None, should_stop=None) -> list[Reply]:
        self.prompts += [list(p) for p in prompts]
        out = []
        for prompt in prompts:
            text = self.tok.decode(prompt)
            ids, end = next(v for k, v in self.replies.items() if text.endswith(k))
            out.append(Reply(list(ids), end))
        return out


def _regenerate(tok, conversations, replies, **settings) -> tuple[list[Regenerated], _Scripted]:
    gen = TurnGenerator(_MODEL, tok, RegenConfig(max_new_tokens=64, **settings), device="cpu", max_length=512,
                        engine=False)  # fmt: skip
    gen.plain = _Scripted(tok, replies)
    return gen.regenerate(list(enumerate(conversations))), gen.plain


def _dataset_replies(tok, conversations) -> dict[str, tuple[list[int], int | None]]:
    """Each turn's prompt ending -> the dataset's answer, tokenized, closed by <|im_end|>."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    replies = {}
    for conv in conversations:
        for i, m in enumerate(conv):
            if m["role"] == "assistant":
                prompt = render_prompt(tok, conv[:i], {})
                replies[prompt[-60:]] = (tok(m["content"], add_special_tokens=False)["input_ids"], end)
    return replies


def _assert_equals_rendered(tok, record: Regenerated) -> None:
    ids, mask = render_conversation(tok, record.messages)
    form = record.tokens
    assert form is not None
    n = len(form.ids)
    assert form.ids == ids[:n]
    assert form.mask().tolist() == mask[:n].tolist()
    assert not mask[n:].any()  # what the template writes after the last turn ("\n") is never trained


def test_the_ids_of_finished_turns_equal_the_rendered_conversation(tok):
    records, decoder = _regenerate(tok, CONVERSATIONS, _dataset_replies(tok, CONVERSATIONS))
    assert [r.messages for r in records] == CONVERSATIONS  # the script answered as the dataset does
    for record in records:
        _assert_equals_rendered(tok, record)
        assert len(record.tokens.trained) == record.turns
    # the last prompt prefilled is the start of the sample: nothing was rendered after it
    last = decoder.prompts[-1]
    assert any(r.tokens.ids[: len(last)] == last for r in records)


def test_the_sample_is_the_target_ids_and_equals_the_rendered_sample(tok):
    records, _ = _regenerate(tok, CONVERSATIONS, _dataset_replies(tok, CONVERSATIONS))
    cfg = DataConfig(path=Path("unused.jsonl"), max_length=512)
    for record in records:
        sample = sample_or_reason(record, record.index, tok, cfg)
        rendered = sample_or_reason(dataclasses.replace(record, tokens=None), record.index, tok, cfg)
        n = sample.input_ids.numel()
        assert sample.input_ids.tolist() == rendered.input_ids[:n].tolist()
        assert sample.loss_mask.tolist() == rendered.loss_mask[:n].tolist()


def test_ids_the_text_would_not_give_back_are_kept_in_a_one_turn_sample(tok):
    """The target wrote "cat" as three single letters: re-tokenizing its text gives other ids; the sample
    trains the ids the target wrote."""
    conv = [{"role": "user", "content": "Name a pet."}, {"role": "assistant", "content": "x"}]
    letters = [tok.convert_tokens_to_ids(c) for c in "cat"]
    assert tok("cat", add_special_tokens=False)["input_ids"] != letters  # the text tokenizes otherwise
    end = tok.convert_tokens_to_ids("<|im_end|>")
    (record,), _ = _regenerate(tok, [conv], {"assistant\n": (letters, end)})
    assert record.messages[-1]["content"] == "cat"
    assert record.tokens.ids[-4:] == [*letters, end] and record.tokens.trained == [(len(record.tokens.ids) - 4,
                                                                                  len(record.tokens.ids))]  # fmt: skip
    sample = sample_or_reason(record, 0, tok, DataConfig(path=Path("unused.jsonl"), max_length=512))
    assert sample.input_ids[-4:].tolist() == [*letters, end]


def test_a_later_prompt_that_does_not_extend_the_ids_falls_back_to_the_rendered_text(tok):
    """Turn 1's letters come back as other ids in turn 2's prompt: the chain breaks, the sample is rendered."""
    conv = CONVERSATIONS[0]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    letters = [tok.convert_tokens_to_ids(c) for c in "cat"]
    replies = {"What is a cat?<|im_end|>\n<|im_start|>assistant\n": (letters, end),
               "And a dog?<|im_end|>\n<|im_start|>assistant\n": (tok("dog", add_special_tokens=False)["input_ids"], end)}  # fmt: skip
    (record,), _ = _regenerate(tok, [conv], replies)
    assert record.turns == 2 and record.tokens is None
    sample = sample_or_reason(record, 0, tok, DataConfig(path=Path("unused.jsonl"), max_length=512))
    ids, mask = render_conversation(tok, record.messages)
    assert sample.input_ids.tolist() == ids and sample.loss_mask.tolist() == mask.tolist()


def test_a_template_that_rewrites_an_earlier_turn_falls_back_to_the_rendered_text(tok):
    tok = copy.deepcopy(tok)
    tok.chat_template = DROPS_OLD_REASONING
    conv = CONVERSATIONS[0]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    thought = tok("<think>\nhm\n</think>\n\nA pet.", add_special_tokens=False)["input_ids"]
    replies = {"What is a cat?<|im_end|>\n<|im_start|>assistant\n": (thought, end),
               "And a dog?<|im_end|>\n<|im_start|>assistant\n": (tok("Also.", add_special_tokens=False)["input_ids"], end)}  # fmt: skip
    (record,), _ = _regenerate(tok, [conv], replies)
    assert record.turns == 2 and record.tokens is None
    one_turn = [conv[:3]]
    (single,), _ = _regenerate(tok, one_turn, replies)  # one turn: nothing to rewrite, the ids stand
    _assert_equals_rendered(tok, single)


def test_a_reply_cut_at_the_limit_trains_no_end_token_after_it(tok):
    """The rendered text closes every turn with <|im_end|>; the target never wrote it after a cut reply,
    so the ids form stops at the reply."""
    conv = CONVERSATIONS[1]
    cut = tok("red red red", add_special_tokens=False)["input_ids"]
    (record,), _ = _regenerate(tok, [conv], {"assistant\n": (cut, None)})
    assert record.truncated == 1 and record.tokens.ids[-len(cut) :] == cut
    ids, mask = render_conversation(tok, record.messages)
    n = len(record.tokens.ids)
    assert record.tokens.ids == ids[:n] and ids[n] == tok.convert_tokens_to_ids("<|im_end|>") and mask[n]


def test_the_form_survives_the_file_line_and_bad_forms_are_not_read():
    form = TokenForm([5, 6, 7, 8, 9], [(2, 4)])
    record = Regenerated(index=3, messages=[{"role": "assistant", "content": "x"}], turns=1, tokens=form)
    back = Regenerated.from_line(record.to_line())
    assert back.tokens == form and back.tokens.mask().tolist() == [False, False, True, True, False]
    assert TokenForm.from_json({"ids": [1, 2], "trained": [[1, 3]]}) is None  # past the end
    assert TokenForm.from_json({"ids": [1, "2"], "trained": []}) is None
    assert TokenForm.from_json({"ids": [1, 2], "trained": [[1]]}) is None  # a span that is not two numbers
    assert Regenerated.from_line({"messages": [], "regen": {"index": 1}}).tokens is None  # older files


def test_extending_needs_the_prompt_to_begin_with_everything_so_far():
    form = TokenForm().extended([1, 2], [3, 4], 9)
    assert form == TokenForm([1, 2, 3, 4, 9], [(2, 5)])
    assert form.extended([1, 2, 3, 4, 9, 7], [8], None) == TokenForm([1, 2, 3, 4, 9, 7, 8], [(2, 5), (6, 7)])
    assert form.extended([1, 2, 3, 5, 9, 7], [8], None) is None
    assert np.flatnonzero(form.mask()).tolist() == [2, 3, 4]
