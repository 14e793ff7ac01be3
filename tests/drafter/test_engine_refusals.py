"""What the serving engines would refuse is refused when the drafter config is built, before training: a
feature layer they cannot capture (the target's last: vLLM and SGLang capture layer id+1's input) and a mask
token id that the tokenizer's "<|MASK|>" contradicts (SGLang's check)."""

from __future__ import annotations

import pytest

from dflash_pipe.config.drafter import EngineConflictError, default_target_layer_ids
from dflash_pipe.config.mask_token import ENGINE_MASK_TOKEN, resolve_mask_token_id
from dflash_pipe.drafter import DrafterConfig
from tests.tiny_models import tiny_qwen3_config


class _Tok:
    def __init__(self, vocab: dict[str, int], mask_token_id=None) -> None:
        self.vocab, self.mask_token_id = vocab, mask_token_id

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def __len__(self) -> int:
        return len(self.vocab)


def _one_line(exc: BaseException, *needles: str) -> None:
    text = str(exc)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, text


def test_the_last_layer_is_refused_naming_the_flag_the_value_and_why() -> None:
    tc = tiny_qwen3_config(num_hidden_layers=8)
    with pytest.raises(EngineConflictError) as info:
        DrafterConfig.from_target(tc, mask_token_id=3, num_layers=2, target_layer_ids=(1, 7))
    _one_line(
        info.value, "--target-layer-ids 1,7", "7 is the target's last layer", "8 layers", "vLLM and SGLang"
    )
    _one_line(info.value, "input of layer id+1", "Pick ids in 0-6")
    assert DrafterConfig.from_target(
        tc, mask_token_id=3, num_layers=2, target_layer_ids=(1, 6)
    ).target_layer_ids


@pytest.mark.parametrize("layers", range(2, 97))
def test_the_default_never_picks_the_last_layer(layers: int) -> None:
    for n in range(1, 9):
        ids = default_target_layer_ids(layers, n)
        if list(ids) != sorted(set(ids)):  # too shallow for n distinct layers: refused elsewhere
            continue
        assert layers - 1 not in ids and ids[0] >= 0, (layers, n, ids)


def test_a_single_feature_layer_on_a_two_layer_target_is_layer_0() -> None:
    cfg = DrafterConfig.from_target(tiny_qwen3_config(num_hidden_layers=2), mask_token_id=3, num_layers=1)
    assert cfg.target_layer_ids == (0,)


def test_a_mask_token_id_the_tokenizer_contradicts_is_refused_naming_both_ids() -> None:
    tok = _Tok({"a": 0, "b": 1, ENGINE_MASK_TOKEN: 7})
    with pytest.raises(EngineConflictError) as info:
        DrafterConfig.from_target(tiny_qwen3_config(), tokenizer=tok, mask_token_id=3, num_layers=1)
    _one_line(info.value, "--mask-token-id 3", "<|MASK|> as id 7", "SGLang refuses", "pass --mask-token-id 7")
    cfg = DrafterConfig.from_target(tiny_qwen3_config(), tokenizer=tok, num_layers=1)
    assert cfg.mask_token_id == 7  # left out: the tokenizer's <|MASK|>


def test_a_mask_token_past_the_embedding_cannot_be_matched() -> None:
    tok = _Tok({"a": 0, "b": 1, ENGINE_MASK_TOKEN: 60})  # tiny target: vocab_size 60
    with pytest.raises(EngineConflictError) as info:
        DrafterConfig.from_target(tiny_qwen3_config(), tokenizer=tok, num_layers=1)
    _one_line(info.value, "as id 60", "past the target's embedding (vocab_size=60)", "no <|MASK|>")


def test_the_engines_mask_token_name_wins_over_the_others() -> None:
    assert resolve_mask_token_id(_Tok({"<|mask|>": 1, ENGINE_MASK_TOKEN: 2}), 10) == 2
    assert resolve_mask_token_id(_Tok({"a": 0, "<|mask|>": 1}), 10) == 1
