"""Real speculative decoding: lossless against HF greedy `generate`, the acceptance counts, the stops."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3ForCausalLM

from dflash_pipe.drafter import DFlashDrafter, speculate
from dflash_pipe.drafter.generate_eval import (
    end_of_turn_ids,
    evaluate_generate,
    prompts_from_samples,
)
from dflash_pipe.drafter.speculate import (
    LosslessError,
    check_lossless,
    drafter_proposer,
    greedy_generate,
    speculative_generate,
    stack_greedy_generate,
)
from tests.tiny_models import tiny_qwen3_config

from .conftest import tiny_config

BS = 4
LAYERS = (0, 2)


@pytest.fixture(scope="module")
def target() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = tiny_qwen3_config(num_hidden_layers=4, vocab_size=50, attn_implementation="sdpa")
    return Qwen3ForCausalLM(cfg).eval()


def drafter_for(target: Qwen3ForCausalLM, seed: int = 1) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = tiny_config(block_size=BS, target_layer_ids=LAYERS, num_target_layers=4)
    return DFlashDrafter(cfg, target.get_input_embeddings(), target.lm_head).eval()


def prompts(n: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [
        torch.randint(0, 48, (int(torch.randint(3, 12, (1,), generator=gen)),), generator=gen)
        for _ in range(n)
    ]


def oracle(target: Qwen3ForCausalLM, prompt: torch.Tensor, horizon: int) -> speculate.Proposer:
    """A proposer that drafts the target's own greedy continuation (computed ahead by HF generate)."""
    greedy = greedy_generate(target, prompt, max_new_tokens=horizon).tokens

    def propose(tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        done = tokens.numel() - prompt.numel()  # generated so far, the block's first token included
        assert tokens[prompt.numel() :].tolist() == greedy[:done]
        assert features.shape[0] == tokens.numel() - 1  # features of every verified token, none more
        return torch.tensor(greedy[done : done + BS - 1])

    return propose


def test_lossless_against_hf_generate(target) -> None:
    drafter = drafter_for(target)
    result = evaluate_generate(target, drafter, prompts(), max_new_tokens=24, stop_ids=())
    assert result.mismatches == 0
    for p in result.prompts:
        assert len(p.spec.tokens) == 24 and p.spec.tokens == p.greedy.tokens
        assert p.spec.target_forwards == 1 + p.spec.counts.anchors == 1 + len(p.spec.per_step)
    assert result.counts.anchors >= 24 * 3 // BS  # at most bs tokens per step


@pytest.mark.parametrize("engine", [True, False])
def test_the_speed_baseline_decodes_what_hf_generate_decodes(target, engine) -> None:
    """The speedup's baseline is greedy decoding on the verify stack, one token a step: HF generate's tokens,
    stops included, on the slot stack and on HF's forward with its cache."""
    for prompt in prompts():
        free = greedy_generate(target, prompt, max_new_tokens=20).tokens
        base = stack_greedy_generate(target, prompt, layer_ids=LAYERS, max_new_tokens=20, engine=engine)
        assert base.tokens == free and base.seconds > 0
        stop = free[5]
        stopped = stack_greedy_generate(
            target, prompt, layer_ids=LAYERS, max_new_tokens=20, stop_ids=[stop], engine=engine
        )
        assert stopped.tokens == free[: free.index(stop) + 1]
    with pytest.raises(ValueError, match="max_new_tokens"):
        stack_greedy_generate(target, prompts(1)[0], layer_ids=LAYERS, max_new_tokens=0)


def test_the_speedup_is_against_the_stack_and_hf_generate_is_said_beside_it(target) -> None:
    references: dict = {}
    result = evaluate_generate(
        target, drafter_for(target), prompts(), max_new_tokens=12, stop_ids=(), references=references
    )
    assert sorted(references) == [0, 1, 2]
    for p, ref in zip(result.prompts, references.values(), strict=True):
        assert p.baseline is ref.baseline and p.greedy is ref.greedy
        assert p.baseline.tokens == p.greedy.tokens == p.spec.tokens
    metrics = result.metrics()
    stack_rate = sum(len(p.baseline.tokens) for p in result.prompts) / sum(
        p.baseline.seconds for p in result.prompts
    )
    assert metrics["real/greedy_tokens_per_s"] == pytest.approx(stack_rate)
    assert metrics["real/speedup"] == pytest.approx(result.tokens_per_s / stack_rate)
    hf_rate = sum(len(p.greedy.tokens) for p in result.prompts) / sum(
        p.greedy.seconds for p in result.prompts
    )
    assert metrics["real/hf_generate_tokens_per_s"] == pytest.approx(hf_rate)
    steps = metrics["real/steps"]
    draft_ms, verify_ms = metrics["real/draft_ms_per_step"], metrics["real/verify_ms_per_step"]
    assert draft_ms > 0 and verify_ms > 0
    assert (draft_ms + verify_ms) * steps / 1e3 <= result.seconds  # parts of the decoding's wall time
    again = evaluate_generate(
        target, drafter_for(target), prompts(), max_new_tokens=12, stop_ids=(), references=references
    )
    assert [p.baseline for p in again.prompts] == [r.baseline for r in references.values()]  # computed once


def test_check_catches_a_wrong_acceptance_rule(target, monkeypatch) -> None:
    drafter = drafter_for(target)
    monkeypatch.setattr(speculate, "accepted_length", lambda draft, greedy: len(draft))  # accept all
    with pytest.raises(LosslessError, match="not lossless"):
        evaluate_generate(target, drafter, prompts(1), max_new_tokens=24, stop_ids=())


def test_check_catches_a_forced_wrong_draft_accepted(target, monkeypatch) -> None:
    """A drafter forced to draft token 7 everywhere, with an acceptance rule that trusts the first draft."""
    prompt = prompts(1)[0]
    monkeypatch.setattr(speculate, "accepted_length", lambda draft, greedy: 1)
    spec = speculative_generate(
        target,
        lambda t, f: torch.full((BS - 1,), 7),
        prompt,
        layer_ids=LAYERS,
        block_size=BS,
        max_new_tokens=12,
    )
    greedy = greedy_generate(target, prompt, max_new_tokens=12)
    assert 7 in spec.tokens
    with pytest.raises(LosslessError, match="first difference"):
        check_lossless(spec.tokens, greedy.tokens)


def test_oracle_drafter_reaches_tau_block_size(target) -> None:
    prompt = prompts(1)[0]
    steps = 5
    new = 1 + steps * BS  # the prefill's token, then full blocks
    spec = speculative_generate(
        target, oracle(target, prompt, new + BS), prompt, layer_ids=LAYERS, block_size=BS, max_new_tokens=new
    )
    assert spec.counts.tau == BS
    assert spec.per_step == [BS] * steps
    assert spec.counts.per_slot_rate[1:].tolist() == [1.0] * (BS - 1)
    assert spec.tokens == greedy_generate(target, prompt, max_new_tokens=new).tokens


@pytest.mark.parametrize("engine", [True, False], ids=["slot-engine", "hf-forward"])
def test_partial_acceptance_crops_the_cache_right(target, engine) -> None:
    """Drafts right up to a wrong token at a position that moves each step: every accepted length from 0 to
    bs-2 occurs, each step rolls the cache back mid-block (HF: ``crop``; the slot engine: the next block
    overwrites), and the output still equals greedy decoding."""
    prompt = prompts(1)[0]
    right = oracle(target, prompt, 60)
    calls = []

    def propose(tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        draft = right(tokens, features).clone()
        wrong = len(calls) % (BS - 1)
        draft[wrong] = (draft[wrong] + 1) % 48
        calls.append(wrong)
        return draft

    spec = speculative_generate(
        target, propose, prompt, layer_ids=LAYERS, block_size=BS, max_new_tokens=40, engine=engine
    )
    assert spec.tokens == greedy_generate(target, prompt, max_new_tokens=40).tokens
    assert spec.per_step[:-1] == [w + 1 for w in calls[:-1]]  # `wrong` drafts accepted, plus the bonus


@pytest.mark.parametrize("engine", [True, False], ids=["slot-engine", "hf-forward"])
def test_the_drafter_sees_the_features_of_every_verified_token(target, engine) -> None:
    """The features handed to the drafter (prefill, then each verified block, cropped) equal one plain HF
    forward over the same tokens: no rejected draft's features, none missing, none stale."""
    prompt = prompts(1)[0]
    seen = []
    right = oracle(target, prompt, 60)

    def propose(tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        seen.append((tokens.clone(), features.clone()))
        draft = right(tokens, features).clone()
        draft[len(seen) % (BS - 1)] = 0 if draft[len(seen) % (BS - 1)] else 1  # reject part of each block
        return draft

    speculative_generate(
        target, propose, prompt, layer_ids=LAYERS, block_size=BS, max_new_tokens=30, engine=engine
    )
    tokens, features = seen[-1]
    with torch.no_grad():
        full = target(input_ids=tokens[None], output_hidden_states=True).hidden_states
    want = speculate.context_features(full, LAYERS)[0, :-1]  # every token but the block's first
    torch.testing.assert_close(features, want, rtol=1e-4, atol=1e-5)


def test_a_dflash_drafter_that_drafts_the_greedy_tokens_reaches_tau_block_size() -> None:
    """A real DFlashDrafter whose draft equals the target's greedy choice: both put zeros through their
    final norm, so every logit is 0 and argmax picks token 0, for the drafter and for the target alike."""
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(tiny_qwen3_config(num_hidden_layers=4, vocab_size=50)).eval()
    drafter = drafter_for(target)
    with torch.no_grad():
        target.model.norm.weight.zero_()
        drafter.norm.weight.zero_()
    steps = 4
    spec = speculative_generate(
        target,
        drafter_proposer(drafter),
        torch.tensor([5, 6, 7]),
        layer_ids=LAYERS,
        block_size=BS,
        max_new_tokens=1 + steps * BS,
    )
    assert spec.tokens == [0] * (1 + steps * BS) and spec.per_step == [BS] * steps
    assert spec.counts.tau == BS and spec.drafter_forwards == steps


def test_per_position_acceptance_sums(target) -> None:
    result = evaluate_generate(target, drafter_for(target, seed=3), prompts(), max_new_tokens=30, stop_ids=())
    for p in result.prompts:
        c = p.spec.counts
        assert (
            sum(p.spec.per_step) == len(p.spec.tokens) - 1
        )  # every token but the prefill's came from a step
        for k in range(1, BS):  # position k kept by the steps that produced more than k tokens
            assert int(c.per_slot_accepted[k]) == sum(n > k for n in p.spec.per_step)
        assert c.tau == pytest.approx(1 + float(c.per_slot_rate[1:].sum()))
        assert c.tau == pytest.approx(sum(p.spec.per_step) / len(p.spec.per_step))
    metrics = result.metrics()
    assert metrics["real/tau_pooled"] == pytest.approx(1 + sum(metrics["real/acceptance_per_position"]))
    per_prompt = [sum(p.spec.per_step) / len(p.spec.per_step) for p in result.prompts]
    assert metrics["real/tau"] == pytest.approx(sum(per_prompt) / len(per_prompt))  # the reference's mean


def test_stops_at_end_of_turn(target) -> None:
    prompt = prompts(1)[0]
    free = greedy_generate(target, prompt, max_new_tokens=30).tokens
    stop = free[6]
    first = free.index(stop)
    for propose in (drafter_proposer(drafter_for(target)), oracle(target, prompt, 40)):
        spec = speculative_generate(
            target, propose, prompt, layer_ids=LAYERS, block_size=BS, max_new_tokens=30, stop_ids=[stop]
        )
        assert spec.tokens == free[: first + 1]  # kept, and nothing after it
        assert spec.tokens == greedy_generate(target, prompt, max_new_tokens=30, stop_ids=[stop]).tokens
    # the reference stops where it is told, not where the model's generation config says
    saved = target.generation_config.eos_token_id
    target.generation_config.eos_token_id = stop
    try:
        assert greedy_generate(target, prompt, max_new_tokens=30).tokens == free
    finally:
        target.generation_config.eos_token_id = saved


def test_prompt_and_end_of_turn_from_the_data() -> None:
    from types import SimpleNamespace

    from dflash_pipe.data import demo_tokenizer

    tok = demo_tokenizer()
    samples = [
        SimpleNamespace(input_ids=torch.arange(6), loss_mask=torch.tensor([0, 0, 0, 1, 1, 0]).bool()),
        SimpleNamespace(input_ids=torch.arange(3), loss_mask=torch.tensor([1, 1, 1]).bool()),  # no prompt
        SimpleNamespace(input_ids=torch.arange(4), loss_mask=torch.zeros(4).bool()),  # no assistant turn
        SimpleNamespace(input_ids=torch.arange(5) + 10, loss_mask=torch.tensor([0, 1, 1, 1, 1]).bool()),
    ]
    got = prompts_from_samples(samples, max_prompts=5)
    assert [p.tolist() for p in got] == [[0, 1, 2], [10]]
    assert len(prompts_from_samples(samples, max_prompts=1)) == 1
    ids = end_of_turn_ids(tok)
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids and tok.eos_token_id in ids


def test_bad_inputs_are_named(target) -> None:
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(
            target, lambda t, f: t, torch.tensor([1]), layer_ids=LAYERS, block_size=BS, max_new_tokens=0
        )
    with pytest.raises(ValueError, match="no prompts"):
        evaluate_generate(target, drafter_for(target), [], max_new_tokens=4, stop_ids=())


def test_accepted_length_counts_the_leading_matches() -> None:
    from dflash_pipe.drafter.speculate import accepted_length

    assert accepted_length([1, 2, 3], [1, 2, 4]) == 2
    assert accepted_length([1, 2, 3], [1, 2, 3]) == 3
    assert accepted_length([7, 2, 3], [1, 2, 3]) == 0  # a later match after a miss counts for nothing
    assert accepted_length([], []) == 0  # greedy decoding: nothing drafted
    with pytest.raises(ValueError):
        accepted_length([1, 2], [1])
