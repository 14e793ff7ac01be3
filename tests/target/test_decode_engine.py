"""The slot engine checked against HF's own ``generate``, per conversation and per family; its continuous
batching and its reuse of a conversation's cache from one turn to the next."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3MoeConfig

from dflash_pipe.data import demo_tokenizer
from dflash_pipe.data.config import RegenConfig
from dflash_pipe.data.render import render_prompt
from dflash_pipe.target.decode import (
    DecodeStack,
    GenerationStopped,
    SlotEngine,
    TurnRequest,
    unsupported_reason,
)
from dflash_pipe.target.generate import TurnGenerator
from tests.target.conversations import CONVERSATIONS as BASE
from tests.tiny_models import tiny_qwen3_config

CONVERSATIONS = [
    [
        *BASE[0],
        {"role": "user", "content": "And a bird, then?"},
        {"role": "assistant", "content": "DATASET ANSWER THREE"},
    ],
    *BASE[1:],
    [{"role": "user", "content": "Why is the sky blue?"}, {"role": "assistant", "content": "DATASET SKY"}],
    [
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": "DATASET STORY"},
        {"role": "user", "content": "Shorter."},
        {"role": "assistant", "content": "DATASET SHORT"},
    ],
]
"""The shared three, the first with a third turn, and two more: five conversations for two slots."""
LIMIT = 12


@pytest.fixture(scope="module")
def tokenizer():
    return demo_tokenizer()


def _model(config, dtype=torch.float32):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def model(tokenizer):
    return _model(tiny_qwen3_config(vocab_size=len(tokenizer), max_position_embeddings=512))


def _hf_reply(model, prompt: list[int], limit: int, end_ids: list[int]) -> list[int]:
    """The reference: HF ``generate``, greedy, one prompt alone."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=limit,
            do_sample=False,
            eos_token_id=end_ids,
            pad_token_id=end_ids[0],
        )[0, len(prompt) :].tolist()
    return out[:-1] if out and out[-1] in end_ids else out


def _hf_conversation(model, tokenizer, messages, end_ids):
    out: list[dict] = []
    for m in messages:
        if m["role"] != "assistant":
            out.append(dict(m))
            continue
        prompt = tokenizer(render_prompt(tokenizer, out, {}), add_special_tokens=False)["input_ids"]
        reply = tokenizer.decode(_hf_reply(model, prompt, LIMIT, end_ids))
        if not reply.strip():
            break
        out.append({"role": "assistant", "content": reply})
    return out


def _generator(model, tokenizer, slots: int = 2, **settings) -> TurnGenerator:
    cfg = RegenConfig(**{"max_new_tokens": LIMIT, "batch_size": slots, **settings})
    return TurnGenerator(model, tokenizer, cfg, device="cpu", max_length=256)


def test_greedy_regeneration_equals_hf_generate_per_conversation(model, tokenizer):
    """Five conversations on two slots: every turn equals HF generate on the conversation alone."""
    gen = _generator(model, tokenizer, slots=2)
    assert gen.engine() is not None
    got = gen.regenerate(list(enumerate(CONVERSATIONS)))
    for conv, result in zip(CONVERSATIONS, got, strict=True):
        assert result.messages == _hf_conversation(model, tokenizer, conv, gen.end_ids)
    assert sum(r.turns for r in got) >= 8
    stats = gen.engine_stats
    assert stats.turns == sum(r.turns for r in got) + sum(r.failed is not None for r in got)


def test_turn_k_plus_1_prefills_only_what_follows_turn_k(model, tokenizer):
    gen = _generator(model, tokenizer, slots=1)
    engine = gen.engine()
    starts: list[list[int]] = []
    prefill = engine.stack.prefill
    engine.stack.prefill = lambda cache, slots, seqs, begin: (
        starts.append(list(begin)) or prefill(cache, slots, seqs, begin)
    )
    (result,) = gen.regenerate([(0, CONVERSATIONS[0])])
    assert result.turns == 3, result
    stats = gen.engine_stats
    prompts = [
        tokenizer(render_prompt(tokenizer, result.messages[:i], {}), add_special_tokens=False)["input_ids"]
        for i, m in enumerate(result.messages)
        if m["role"] == "assistant"
    ]
    assert stats.prefilled + stats.reused == sum(len(p) for p in prompts)
    # turns 2 and 3 start where the previous prompt and its reply end (the reply round-trips here)
    assert starts[0] == [0] and all(s[0] > len(prompts[i]) for i, s in enumerate(starts[1:]))
    assert stats.reused >= len(prompts[0]) + len(prompts[1])
    assert stats.prefilled < sum(len(p) for p in prompts) / 2


class _Prompt:
    def __init__(self, request: TurnRequest) -> None:
        self.request: TurnRequest | None = request
        self.reply: list[int] | None = None

    def next_request(self):
        request, self.request = self.request, None
        return request

    def take(self, tokens, end):
        self.reply = tokens


def _engine(model, slots: int, max_len: int = 128, **kw) -> SlotEngine:
    stack = DecodeStack(model, max_len=max_len)
    return SlotEngine(stack, slots=slots, max_new=64, end_ids=[-1], greedy=True, check_every=4, **kw)


def test_a_slot_takes_the_next_prompt_while_the_others_still_decode(model):
    """One long reply (40 tokens) and eight short ones (3) on two slots: the short ones run beside the long
    one, so the whole run takes about the long reply's steps, not the sum of rounds."""
    prompts = [list(range(5 + i, 15 + i)) for i in range(9)]
    limits = [40] + [3] * 8
    engine = _engine(model, slots=2)
    sessions = [_Prompt(TurnRequest(p, n)) for p, n in zip(prompts, limits, strict=True)]
    stats = engine.run(sessions)
    assert stats.steps <= 44, stats
    for session, prompt, limit in zip(sessions, prompts, limits, strict=True):
        assert session.reply == _hf_reply(model, prompt, limit, [-1])


@pytest.mark.slow  # ~14 s on 2 shared cores
def test_turns_that_end_one_by_one_share_prefill_calls(model, monkeypatch):
    """32 slots, replies of 2 to 33 tokens, a check after every step: turns end one or two at a time,
    and each prefill call (which stops every slot's decoding) takes several of them: at most half the calls
    of prefilling at every check that ended a turn. The replies are still HF's."""
    from dflash_pipe.target.decode import engine as engine_module

    prompts = [list(range(3 + i % 7, 13 + i % 11)) for i in range(96)]
    limits = [2 + (i * 7) % 32 for i in range(96)]

    def run():
        engine = _engine(model, slots=32)
        engine.check_every = 1
        sessions = [_Prompt(TurnRequest(p, n)) for p, n in zip(prompts, limits, strict=True)]
        return engine.run(sessions), sessions

    grouped, sessions = run()
    monkeypatch.setattr(engine_module, "PREFILL_WAIT", 0)
    at_once, _ = run()
    assert grouped.turns == at_once.turns == 96
    assert grouped.prefill_calls * 2 <= at_once.prefill_calls, (grouped, at_once)
    for session, prompt, limit in zip(sessions[::9], prompts[::9], limits[::9], strict=True):
        assert session.reply == _hf_reply(model, prompt, limit, [-1])


SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=80,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "original_max_position_embeddings": 16,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(**SMALL, rope_scaling=LLAMA3_ROPE),
        Qwen2Config(**SMALL),
        Qwen3MoeConfig(**SMALL, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8),
    ],
    ids=["llama3-rope", "qwen2-bias", "qwen3-moe"],
)
def test_each_family_decodes_as_hf_generate(config):
    model = _model(config)
    if isinstance(config, Qwen2Config):  # biases of zero would hide a missing bias
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.q_proj.bias, std=0.5)
    assert unsupported_reason(model) is None
    prompts = [list(range(3 + i, 3 + i + 7 + 5 * i)) for i in range(4)]
    engine = _engine(model, slots=3)
    sessions = [_Prompt(TurnRequest(p, 10)) for p in prompts]
    engine.run(sessions)
    for session, prompt in zip(sessions, prompts, strict=True):
        assert session.reply == _hf_reply(model, prompt, 10, [-1])


def test_a_family_the_engine_does_not_serve_falls_back_with_one_log_line(tokenizer, caplog):
    config = tiny_qwen3_config(
        vocab_size=len(tokenizer), max_position_embeddings=512, use_sliding_window=True, sliding_window=8
    )
    model = _model(config)
    assert "sliding window" in unsupported_reason(model)
    gen = _generator(model, tokenizer)
    with caplog.at_level(logging.WARNING, logger="dflash_pipe.target"):
        got = gen.regenerate(list(enumerate(CONVERSATIONS[:2])))
        gen.regenerate(list(enumerate(CONVERSATIONS[:2])))
    lines = [r for r in caplog.records if "plain path" in r.getMessage()]
    assert len(lines) == 1 and "sliding window" in lines[0].getMessage()
    assert gen.engine() is None and any(r.turns for r in got)


def test_a_target_split_across_devices_is_left_to_the_plain_path(tokenizer):
    model = _model(tiny_qwen3_config(vocab_size=len(tokenizer)))
    model.model.layers[1].to("meta")  # any second device: the engine's cache lives on one
    assert "split across 2 devices" in unsupported_reason(model)


def test_sampled_turns_do_not_depend_on_the_slot_count(model, tokenizer):
    settings = {"temperature": 1.0, "top_p": 0.9, "seed": 5}
    items = list(enumerate(CONVERSATIONS))
    one = _generator(model, tokenizer, slots=1, **settings).regenerate(items)
    four = _generator(model, tokenizer, slots=4, **settings).regenerate(items)
    other = _generator(model, tokenizer, slots=4, **{**settings, "seed": 6}).regenerate(items)
    assert [r.messages for r in one] == [r.messages for r in four]
    assert [r.messages for r in one] != [r.messages for r in other]


def test_should_stop_stops_the_engine(model, tokenizer):
    gen = _generator(model, tokenizer)
    with pytest.raises(GenerationStopped):
        gen.regenerate(list(enumerate(CONVERSATIONS)), should_stop=lambda: True)


def test_a_turn_that_does_not_fit_the_cache_is_a_clear_error(model):
    engine = _engine(model, slots=1, max_len=16)
    with pytest.raises(ValueError, match="does not fit the engine's 16 positions"):
        engine.run([_Prompt(TurnRequest(list(range(5, 15)), 10))])


def test_conversations_added_between_checks_take_the_freed_slots(model, tokenizer):
    """``between`` hands over more conversations mid-call (a producer's next job): they decode in the
    same call, as slots free up, exactly as they decode alone; each is reported by ``on_done``."""
    gen = _generator(model, tokenizer, slots=2)
    later = list(enumerate(CONVERSATIONS))[2:]
    calls = []

    def between():
        calls.append(len(calls))
        return [later.pop(0)] if later and len(calls) % 2 else []

    finished = []
    got = gen.regenerate(list(enumerate(CONVERSATIONS))[:2], on_done=finished.append, between=between)
    assert not later and len(calls) > 3
    alone = _generator(model, tokenizer, slots=2).regenerate(list(enumerate(CONVERSATIONS)))
    assert [r.messages for r in got] == [r.messages for r in alone]
    assert sorted(r.index for r in finished) == list(range(len(CONVERSATIONS)))


def test_a_stop_is_heard_after_one_decode_step_and_between_prefill_calls(model, monkeypatch):
    """A drain must not wait for a check's steps or for every pending prefill: ``should_stop`` is polled
    after each decode step and before each prefill call."""
    from dflash_pipe.target.decode import engine as engine_module

    engine = _engine(model, slots=4)
    engine.check_every = 8
    polls = []

    def stop_on(n):
        return lambda: polls.append(1) or len(polls) >= n

    calls = []
    prefill = engine.stack.prefill
    monkeypatch.setattr(engine.stack, "prefill", lambda *a, **k: calls.append(1) or prefill(*a, **k))

    def sessions():
        return [_Prompt(TurnRequest(list(range(5 + i, 15 + i)), 40)) for i in range(4)]

    with pytest.raises(GenerationStopped):  # polled once before the prefill call, then after step 1
        engine.run(sessions(), should_stop=stop_on(2))
    assert len(calls) == 1 and engine.stats.steps == 0  # stopped inside the first check's eight steps
    monkeypatch.setattr(engine_module, "CPU_PREFILL_TOKENS", 10)  # one 10-token row per call
    calls.clear()
    polls.clear()
    with pytest.raises(GenerationStopped):
        engine.run(sessions(), should_stop=stop_on(3))
    assert len(calls) == 2  # the third of four prefill calls never ran


def test_the_plain_path_hands_over_each_conversation_at_the_end_of_its_round(model, tokenizer):
    """A stop on the plain path keeps what the earlier rounds finished: a one-turn conversation is reported
    by ``on_done`` before round 2 is decoded."""
    gen = _generator(model, tokenizer, slots=4, decoder="plain")
    items = list(enumerate(CONVERSATIONS))
    rounds = 0
    finished = []

    def stop() -> bool:
        return rounds >= 1 and bool(finished)

    original = gen.plain.generate

    def counted(*args, **kwargs):
        nonlocal rounds
        out = original(*args, **kwargs)
        rounds += 1
        return out

    gen.plain.generate = counted
    with pytest.raises(GenerationStopped):
        gen.regenerate(items, should_stop=stop, on_done=finished.append)
    one_turn = {i for i, c in items if sum(m["role"] == "assistant" for m in c) == 1}
    assert one_turn and one_turn <= {r.index for r in finished} < {i for i, _ in items}
