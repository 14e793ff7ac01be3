"""The bundled demo assets: tokenizer, chat template, special tokens, dataset."""

from __future__ import annotations

import json

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dflash_pipe.data import DataConfig, demo_data_path, demo_tokenizer, load_samples
from dflash_pipe.data.demo import ASSETS_DIR


def test_assets_are_small():
    assert sum(p.stat().st_size for p in ASSETS_DIR.iterdir()) < 2_200_000


def test_tokenizer_special_tokens_and_template(tok):
    assert 1000 <= len(tok) <= 2000
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.mask_token == "<|mask|>"
    ids = {
        t: tok.convert_tokens_to_ids(t) for t in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|mask|>"]
    }
    assert len(set(ids.values())) == 4 and tok.unk_token_id not in ids.values()
    assert tok.mask_token_id == ids["<|mask|>"]
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert (
        tok.apply_chat_template(msgs, tokenize=False)
        == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
    )
    assert tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n"
    )


def test_round_trip_and_mask_never_produced(tok):
    with open(demo_data_path()) as f:
        convs = [json.loads(next(f))["messages"] for _ in range(50)]
    mask_id = tok.mask_token_id
    for messages in convs:
        text = tok.apply_chat_template(messages, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        assert mask_id not in ids
    plain = "mask <mask> |mask| < | mask | > the quick brown fox 12345 !?"
    ids = tok(plain, add_special_tokens=False)["input_ids"]
    assert mask_id not in ids and tok.decode(ids) == plain
    assert tok("<|mask|>", add_special_tokens=False)["input_ids"] == [mask_id]


def test_save_pretrained_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    direct = PreTrainedTokenizerFast(tokenizer_file=str(ASSETS_DIR / "tokenizer.json"))
    text = "<|im_start|>user\nWhat is 17 plus 25?<|im_end|>\n<|mask|>"
    assert again(text)["input_ids"] == tok(text)["input_ids"] == direct(text)["input_ids"]
    assert again.chat_template == tok.chat_template
    assert (again.mask_token_id, again.eos_token_id, again.pad_token_id) == (
        tok.mask_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    assert len(again) == len(tok)


def test_demo_dataset_loads(tok):
    data = load_samples(DataConfig(path=demo_data_path()), tok)
    lens = data.lengths()
    assert 2900 <= len(data.samples) <= 3100
    assert data.skipped_lines == data.truncated == data.dropped_short == 0
    assert min(lens) >= 30 and max(lens) <= 300 and 60 <= sum(lens) / len(lens) <= 200
    systems = demo_data_path().read_text().count('"role":"system"')
    assert 100 <= systems <= 1000
    assert demo_tokenizer() is not tok  # a fresh object per call
