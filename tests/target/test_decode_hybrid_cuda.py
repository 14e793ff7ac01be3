"""The hybrid slot stack on a GPU, fp32: its greedy turns equal HF ``generate`` there (HF's own forward with
flash-linear-attention's kernels), through the stack alone and through the slot engine with its CUDA graphs,
a second turn going on from the slot's recurrent state. The CPU module (``test_decode_hybrid.py``) proves
the same against HF's torch path; on a machine with fla it is skipped, so this is the GPU's proof."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dflash_pipe.target.decode import SlotEngine
from dflash_pipe.target.decode.hybrid import HybridStack
from tests.target.test_decode_hybrid import BUILDS, MAX_LEN, PROMPTS, _Conversation, _decode, _hf, _model

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
    reason="needs a CUDA GPU and flash-linear-attention (HF's hybrid reference on a GPU)",
)


GPU_TOLERANCE = 2e-2
"""Largest logit difference allowed from HF's on the GPU (logits have std ~1). fla's chunked kernels, which
both HF and the stack's prefill run there, round their dots to tf32: a second turn, prefilled from the
slot's state, was measured 1.3e-2 from HF's forward over the whole prompt (tokens equal); the CPU module's
1e-3 holds on the torch path only."""


def _assert_as_hf(model: torch.nn.Module, prompt: list[int], got: tuple[list[int], torch.Tensor]) -> None:
    expected, expected_logits = _hf(model, prompt, len(got[0]))
    assert got[0] == expected
    assert (got[1].cpu() - expected_logits).abs().max() < GPU_TOLERANCE


@pytest.fixture(scope="module", params=["qwen3_5-text", "qwen3_next"])
def model(request) -> torch.nn.Module:
    assert request.param in BUILDS
    return _model(request.param).cuda()


@torch.inference_mode()
def test_stack_turns_equal_hf_generate_on_cuda(model):
    """Three prompts on slots 0, 2, 3 of four, 8 tokens each, then a second turn of slot 2 from its state."""
    stack = HybridStack(model, MAX_LEN)
    cache = stack.new_cache(4)
    got = _decode(stack, cache, {slot: (p, 0, 8) for slot, p in zip((0, 2, 3), PROMPTS, strict=True)})
    for slot, prompt in zip((0, 2, 3), PROMPTS, strict=True):
        _assert_as_hf(model, prompt, got[slot])
    reply, extra = got[2][0], [17, 18, 19, 3]
    held = len(PROMPTS[1]) + len(reply) - 1
    turn2 = _decode(stack, cache, {2: (reply[-1:] + extra, held, 8)})
    _assert_as_hf(model, PROMPTS[1] + reply + extra, turn2[2])


@torch.inference_mode()
def test_the_engine_with_cuda_graphs_equals_hf_generate(model):
    """Two-turn conversations on two slots through ``SlotEngine`` (its decode steps in CUDA graphs where the
    stack allows): every turn equals HF generate on its prompt alone."""
    stack = HybridStack(model, MAX_LEN)
    engine = SlotEngine(stack, slots=2, max_new=16, end_ids=[-1], greedy=True, check_every=4)
    limits = [6, 9, 5]
    sessions = [_Conversation(p, [[17, 18, 3]], n) for p, n in zip(PROMPTS, limits, strict=True)]
    engine.run(sessions)
    assert engine.use_graphs == stack.graph_safe
    for session, limit in zip(sessions, limits, strict=True):
        assert len(session.turns) == 2
        for prompt, reply in session.turns:
            assert reply == _hf(model, prompt, limit)[0]
