"""The verify step of speculative decoding on the slot stack against HF's own forward of the whole sequence:
logits and feature layers of each block, after blocks that were only partly kept (the rollback)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_pipe.target.decode import DecodeStack
from dflash_pipe.target.decode.verify import BlockVerifier
from tests.tiny_models import tiny_qwen3_config

LAYERS = [0, 1]  # not the last: HF norms its hidden state (hidden_states[-1] is after the final norm)
BS = 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = tiny_qwen3_config(num_hidden_layers=3, vocab_size=64, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()


def _hf(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's forward over the whole sequence: logits and the feature layers' outputs per token."""
    out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    features = torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], dim=-1)
    return out.logits[0], features


@torch.inference_mode()
@pytest.mark.parametrize("attention", ["matmul", "sdpa"])
def test_blocks_equal_hf_forward_of_the_kept_sequence(model, attention) -> None:
    verifier = BlockVerifier(DecodeStack(model, max_len=96, decode_attention=attention), BS, LAYERS)
    gen = torch.Generator().manual_seed(1)
    kept = torch.randint(0, 64, (21,), generator=gen).tolist()
    logits, features = verifier.prefill(kept)
    want_logits, want_features = _hf(model, kept)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(features, want_features, rtol=1e-4, atol=1e-4)
    for keep in (1, 3, BS, 2, 1):  # tokens kept of each block: the rest is rejected and overwritten
        block = torch.randint(0, 64, (BS,), generator=gen)
        logits, features = verifier.verify(block, len(kept))
        want_logits, want_features = _hf(model, kept + block.tolist())
        torch.testing.assert_close(logits, want_logits[-BS:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(features, want_features[-BS:], rtol=1e-4, atol=1e-4)
        kept += block[:keep].tolist()


def test_a_block_of_another_size_or_past_the_end_is_refused(model) -> None:
    verifier = BlockVerifier(DecodeStack(model, max_len=32, decode_attention="matmul"), BS, LAYERS)
    with pytest.raises(ValueError, match="holds 4 tokens, got 3"):
        verifier.verify(torch.zeros(3, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="runs past the stack's 32 positions"):
        verifier.verify(torch.zeros(BS, dtype=torch.long), 30)
