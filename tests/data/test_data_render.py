"""Chat-template rendering: the loss mask covers exactly the assistant contents and their end-of-turn token."""

from __future__ import annotations

import json

import pytest
from data_helpers import conv, trained_runs

from dflash_pipe.data import DataConfig, demo_data_path, load_samples
from dflash_pipe.data.demo import demo_sharegpt_path
from dflash_pipe.data.formats import FormatError
from dflash_pipe.data.render import render_conversation

QWEN25_TEMPLATE = (  # the Qwen2.5 template without tools: injects a default system prompt
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_TEMPLATE = (  # Llama-3 style: header tokens, content trimmed, <|eot_id|> with no newline after it
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
DROP_OLD_THINK_TEMPLATE = (  # Qwen3-like: reasoning of earlier assistant turns is dropped in the full rendering
    "{%- for message in messages %}{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def assistant_texts(messages, suffix: str) -> list[str]:
    return [m["content"] + suffix for m in messages if m["role"] == "assistant"]


def check_mask(tok, messages, eot: str) -> None:
    ids, mask = render_conversation(tok, messages)
    assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    runs = trained_runs(ids, mask)
    assert [tok.decode(r) for r in runs] == assistant_texts(messages, eot)


def test_demo_conversations_mask_exactly_assistant_text(tok):
    with open(demo_data_path()) as f:
        convs = [json.loads(next(f))["messages"] for _ in range(60)]
    assert any(c[0]["role"] == "system" for c in convs)
    for messages in convs:
        check_mask(tok, messages, "<|im_end|>")


def test_system_and_user_never_trained(tok):
    messages = conv(
        ("Spell the word apple.", "apple is spelled a p p l e."), ("Hi", "Hello."), system="Be brief."
    )
    ids, mask = render_conversation(tok, messages)
    untrained = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert untrained == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSpell the word apple.<|im_end|>\n"
        "<|im_start|>assistant\n\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n\n"
    )


def test_same_text_in_user_and_assistant_turns(tok):
    # "Yes." appears as a user turn too: the span must come from the assistant turn's position
    messages = conv(("Yes.", "Yes."), ("Yes.", "No."))
    check_mask(tok, messages, "<|im_end|>")


def test_tool_role_and_assistant_first(tok):
    messages = [
        {"role": "assistant", "content": "How can I help?"},
        {"role": "user", "content": "Weather?"},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    check_mask(tok, messages, "<|im_end|>")


@pytest.mark.parametrize(
    ("template", "eot", "extra"),
    [
        (QWEN25_TEMPLATE, "<|im_end|>", []),
        (LLAMA3_TEMPLATE, "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
    ],
)
def test_real_world_templates(tok, template, eot, extra):
    t = type(tok).from_pretrained(tok.name_or_path)  # private copy: we change its template and vocab
    t.add_special_tokens({"additional_special_tokens": extra})
    t.chat_template = template
    messages = conv(("What is 2 plus 3?", "2 plus 3 is 5."), ("Count from 1 to 3.", "1, 2, 3."))
    check_mask(t, messages, eot)
    check_mask(t, [{"role": "system", "content": "Be nice."}, *messages], eot)


def test_template_that_rewrites_earlier_turns(tok):
    t = type(tok).from_pretrained(tok.name_or_path)
    t.chat_template = DROP_OLD_THINK_TEMPLATE
    messages = conv(
        ("What is 2 plus 3?", "<think>\nadd\n</think>\n\n2 plus 3 is 5."),
        ("And 1 plus 1?", "<think>\nx\n</think>\n\n2."),
    )
    ids, mask = render_conversation(t, messages)
    assert [t.decode(r) for r in trained_runs(ids, mask)] == [
        "2 plus 3 is 5.<|im_end|>",
        "<think>\nx\n</think>\n\n2.<|im_end|>",
    ]


def test_template_errors_are_format_errors(tok):
    t = type(tok).from_pretrained(tok.name_or_path)
    t.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(FormatError, match="template error.*roles must alternate"):
        render_conversation(t, conv(("a", "b")))


def test_sharegpt_and_messages_give_identical_samples(tok, tmp_path):
    head = tmp_path / "head.jsonl"
    with open(demo_data_path()) as f:
        head.write_text("".join(next(f) for _ in range(40)))
    a = load_samples(DataConfig(path=demo_sharegpt_path()), tok).samples
    b = load_samples(DataConfig(path=head), tok).samples
    assert len(a) == len(b) == 40
    for x, y in zip(a, b, strict=True):
        assert x.sample_id == y.sample_id
        assert x.input_ids.tolist() == y.input_ids.tolist()
        assert x.loss_mask.tolist() == y.loss_mask.tolist()
