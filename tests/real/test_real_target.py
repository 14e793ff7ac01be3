"""The real target loads from its package: dflash-pipe's converted folder of SmolLM2-135M-Instruct's GGUF file
holds exactly the weights transformers' own GGUF loader gives (so its logits on a real prompt are the same),
the shape DESIGN.md names, and a tokenizer that renders its ChatML template."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_pipe.data.render import render_prompt
from dflash_pipe.target.gguf import gguf_source

pytestmark = pytest.mark.real

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.mark.slow
def test_converted_folder_equals_transformers_gguf_loader(
    real, smollm2_dir, hf_model, tokenizer, sharegpt_prompts
):
    source = gguf_source(smollm2_dir)
    assert (source["size"], source["mtime_ns"]) == (real.gguf.stat().st_size, real.gguf.stat().st_mtime_ns)
    cfg = hf_model.config
    shape = (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads)
    assert shape + (cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (
        "llama",
        30,
        576,
        9,
        3,
        64,
        49152,
    )
    assert cfg.tie_word_embeddings and len(tokenizer) == cfg.vocab_size

    direct = AutoModelForCausalLM.from_pretrained(
        str(real.gguf.parent), gguf_file=real.gguf.name, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    ours, theirs = hf_model.state_dict(), direct.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name

    messages = [{"role": "user", "content": sharegpt_prompts[0]}]
    ids = tokenizer(render_prompt(tokenizer, messages, {}), add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        got = hf_model(**ids).logits
        want = direct(**ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got[0, -1].argmax() == want[0, -1].argmax()


def test_tokenizer_renders_chatml(real, tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    text = render_prompt(tokenizer, messages[:1], {})
    assert text == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token == "<|im_end|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 2
    # the tokenizer transformers builds from the GGUF file itself: the same text, the same ids
    direct = AutoTokenizer.from_pretrained(str(real.gguf.parent), gguf_file=real.gguf.name)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert direct.apply_chat_template(messages, tokenize=False) == full
    assert (
        direct(full, add_special_tokens=False)["input_ids"]
        == tokenizer(full, add_special_tokens=False)["input_ids"]
    )
