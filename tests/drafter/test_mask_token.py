"""The MASK token is chosen for any tokenizer: the named mask tokens, the tokenizer's own, a free embedding
row, a reserved token, then an unused special token (a SmolLM2-like tokenizer: ids 3-16, 16 first); said in
one line with its text and why, recorded in the drafter config, never a token the data uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_pipe.config.mask_token import (
    MASK_TOKEN_KEY,
    MaskTokenError,
    mask_line,
    resolve_mask_token,
    unused_special_tokens,
)
from dflash_pipe.drafter import DrafterConfig
from tests.target.gguf_files import SPECIALS, write_tiny_gguf

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A converted tiny SmolLM2-like GGUF: its tokenizer has no mask or reserved token, no free row."""
    from dflash_pipe.target.gguf import resolve_target

    root = tmp_path_factory.mktemp("smol")
    return resolve_target(write_tiny_gguf(root / "smol.gguf"), root=root / "cache", say=None)


@pytest.fixture
def smol_tokenizer(smol_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smol_dir))


def test_an_unused_special_token_is_picked_highest_first(smol_tokenizer):
    vocab = len(smol_tokenizer)
    choice = resolve_mask_token(smol_tokenizer, vocab)
    assert (choice.id, choice.text) == (16, "<empty_output>")
    assert "unused special token" in choice.why and "no free embedding row" in choice.why
    assert [i for i, _ in unused_special_tokens(smol_tokenizer, vocab)] == list(range(16, 2, -1))
    line = choice.line()
    assert line.startswith("mask token: id 16 '<empty_output>', an unused special token") and "\n" not in line


def test_bos_eos_pad_unk_and_what_the_template_writes_are_never_picked(smol_tokenizer):
    vocab = len(smol_tokenizer)
    smol_tokenizer.chat_template = smol_tokenizer.chat_template.replace(
        "<|im_start|>assistant\n", "<|im_start|>assistant\n<empty_output>"
    )
    assert resolve_mask_token(smol_tokenizer, vocab).id == 15  # the template writes 16
    picked = {i for i, _ in unused_special_tokens(smol_tokenizer, vocab)}
    assert not picked & {0, 1, 2, 16}


def test_ids_the_data_uses_move_the_choice_on(smol_tokenizer):
    vocab = len(smol_tokenizer)
    assert resolve_mask_token(smol_tokenizer, vocab, used={16, 15}).id == 14
    with pytest.raises(MaskTokenError, match="pass --mask-token-id") as info:
        resolve_mask_token(smol_tokenizer, vocab, used=set(range(vocab)))
    assert "\n" not in str(info.value) and "the data does not use" in str(info.value)


def test_a_free_row_or_the_tokenizers_mask_token_still_come_first(smol_tokenizer):
    assert resolve_mask_token(smol_tokenizer, len(smol_tokenizer) + 4).id == len(smol_tokenizer)
    smol_tokenizer.add_special_tokens({"mask_token": "<|mask|>"})  # past the 281 rows of this target
    assert resolve_mask_token(smol_tokenizer, len(smol_tokenizer)).text == "<|mask|>"


def test_the_choice_is_recorded_in_the_drafter_config(smol_dir: Path, smol_tokenizer):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(smol_dir))
    auto = DrafterConfig.from_target(config, tokenizer=smol_tokenizer, num_layers=1)
    assert auto.mask_token_id == 16 and auto.extra[MASK_TOKEN_KEY]["text"] == "<empty_output>"
    assert DrafterConfig.from_dict(auto.to_dict()).extra == auto.extra
    assert mask_line(auto).startswith("mask token: id 16 '<empty_output>'")
    given = DrafterConfig.from_target(config, tokenizer=smol_tokenizer, num_layers=1, mask_token_id=5)
    assert given.extra[MASK_TOKEN_KEY] == {"id": 5, "text": SPECIALS[5], "why": "given by --mask-token-id"}
