"""``--regen-batch`` auto: slots sized from free memory over one slot's cache (the producer's jobs:
tests/producer/test_regen.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_pipe.data import demo_tokenizer
from dflash_pipe.data.config import RegenConfig
from dflash_pipe.target.decode import DecodeStack
from dflash_pipe.target.decode.hybrid import HybridStack
from dflash_pipe.target.decode.sizing import AUTO_MAX_SLOTS, FALLBACK_SLOTS, auto_slots
from dflash_pipe.target.generate import TurnGenerator
from tests.target import families
from tests.tiny_models import tiny_qwen3_config

MAX_LEN = 96


@pytest.fixture(scope="module")
def dense():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=128), dtype=torch.float32).eval()


def _slot_bytes(config, max_len: int) -> int:
    """One slot of a dense model's cache, counted from its config: keys and values of every layer, one
    trash column."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * (max_len + 1) * head_dim * 4


def test_auto_slots_fill_the_share_of_free_memory_over_one_slot(dense):
    stack = DecodeStack(dense, max_len=MAX_LEN)
    per_slot = _slot_bytes(dense.config, MAX_LEN)
    assert stack.new_cache(1).nbytes == per_slot
    got = auto_slots(stack, share=0.5, free=per_slot * 20 + per_slot // 2)
    assert got.slots == 10 and "10 slots" in got.why and f"{MAX_LEN} tokens" in got.why
    assert auto_slots(stack, share=0.25, free=per_slot * 20).slots == 5


def test_auto_slots_stop_at_the_cap_and_at_one(dense):
    stack = DecodeStack(dense, max_len=MAX_LEN)
    per_slot = stack.new_cache(1).nbytes
    capped = auto_slots(stack, share=1.0, free=per_slot * (AUTO_MAX_SLOTS * 3))
    assert capped.slots == AUTO_MAX_SLOTS and f"at most {AUTO_MAX_SLOTS}" in capped.why
    starved = auto_slots(stack, share=0.5, free=per_slot // 3)
    assert starved.slots == 1 and "--max-length" in starved.why


def test_auto_slots_count_a_hybrids_recurrent_state():
    """A hybrid's slot holds the full-attention layers' keys and values and every DeltaNet layer's fp32
    state and conv window: the sizing divides by all of it."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(families.qwen3_5_text(128, layers=4), dtype=torch.float32)
    stack = HybridStack(model.eval(), MAX_LEN)
    text = model.config.get_text_config()
    full = sum(kind == "full_attention" for kind in text.layer_types)
    kv = 2 * full * text.num_key_value_heads * (MAX_LEN + 1) * text.head_dim * 4
    per_slot = stack.new_cache(1).nbytes
    assert 0 < full < len(text.layer_types) and per_slot > kv
    assert auto_slots(stack, share=1.0, free=per_slot * 7).slots == 7


def test_off_a_gpu_auto_keeps_the_fallback_batch(dense):
    gen = TurnGenerator(dense, demo_tokenizer(), RegenConfig(), device="cpu", max_length=MAX_LEN)
    assert gen.batch_size == FALLBACK_SLOTS == gen.engine().slots
