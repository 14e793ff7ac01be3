"""Regeneration's decoding checked against plain per-conversation loops over HF's own forward (no cache)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_pipe.data import demo_tokenizer
from dflash_pipe.data.config import RegenConfig
from dflash_pipe.data.render import render_prompt
from dflash_pipe.target.conversation import turn_seed
from dflash_pipe.target.generate import TurnGenerator, end_of_turn_ids
from dflash_pipe.target.plain_decode import filtered_probs
from tests.target.conversations import CONVERSATIONS
from tests.tiny_models import tiny_qwen3_config


@pytest.fixture(scope="module")
def tokenizer():
    return demo_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = tiny_qwen3_config(vocab_size=len(tokenizer), max_position_embeddings=512)
    m = AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="sdpa")
    return m.eval()


def _generator(model, tokenizer, engine: bool = True, **settings) -> TurnGenerator:
    cfg = RegenConfig(**{"max_new_tokens": 12, **settings})
    return TurnGenerator(model, tokenizer, cfg, device="cpu", max_length=256, engine=engine)


def _plain_turn(model, prompt: list[int], limit: int, end_ids: list[int], pick) -> list[int]:
    """The reference: a full forward over the whole sequence per token (no cache, no batch)."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for step in range(limit):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            token = pick(logits[None], step)
            if token in end_ids:
                break
            out.append(token)
            ids.append(token)
    return out


def _plain_conversation(model, tokenizer, messages, limit, end_ids, pick_for):
    out: list[dict] = []
    turn = -1
    for m in messages:
        if m["role"] != "assistant":
            out.append(dict(m))
            continue
        turn += 1
        prompt = tokenizer(render_prompt(tokenizer, out, {}), add_special_tokens=False)["input_ids"]
        tokens = _plain_turn(model, prompt, limit, end_ids, pick_for(turn))
        out.append({"role": "assistant", "content": tokenizer.decode(tokens)})
    return out


def test_end_of_turn_comes_from_the_chat_template(tokenizer):
    ids = end_of_turn_ids(tokenizer)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids  # the template's terminator
    assert tokenizer.eos_token_id in ids


@pytest.mark.parametrize("engine", [True, False], ids=["slot-engine", "plain"])
def test_greedy_batched_equals_a_plain_greedy_loop_per_conversation(model, tokenizer, engine):
    gen = _generator(model, tokenizer, engine=engine)
    assert (gen.engine() is not None) == engine
    got = gen.regenerate(list(enumerate(CONVERSATIONS)))
    for conv, result in zip(CONVERSATIONS, got, strict=True):
        want = _plain_conversation(
            model, tokenizer, conv, 12, gen.end_ids, lambda turn: lambda logits, step: int(logits.argmax())
        )
        if result.failed is None:
            assert result.messages == want
        else:  # an empty greedy reply: the reference must agree the turn is empty
            assert result.failed.reason == "empty reply"
            assert want[len(result.messages)]["content"].strip() == ""
    assert any(r.turns for r in got)
    # the one-turn conversation's sample ids: the prompt HF's template renders, then the reference's reply
    one = CONVERSATIONS[1]
    prompt = tokenizer(render_prompt(tokenizer, one[:1], {}), add_special_tokens=False)["input_ids"]
    greedy = lambda logits, step: int(logits.argmax())  # noqa: E731
    reply = _plain_turn(model, prompt, 12, gen.end_ids, greedy)
    with torch.no_grad():  # a reply under the limit stopped at an end-of-turn token: which one
        end = greedy(model(input_ids=torch.tensor([prompt + reply])).logits[:, -1].float(), 0)
    form = got[1].tokens
    assert form is not None and form.ids == prompt + reply + ([end] if len(reply) < 12 else [])
    assert form.trained == [(len(prompt), len(form.ids))]


def test_turn_two_is_prompted_with_the_regenerated_turn_one(model, tokenizer):
    gen = _generator(model, tokenizer)
    seen: list[list[dict]] = []
    original = gen._prompt

    def spy(state):
        seen.append([dict(m) for m in state.out])
        return original(state)

    gen._prompt = spy
    (result,) = gen.regenerate([(0, CONVERSATIONS[0])])
    assert result.turns == 2, result
    second = seen[1]
    assert second[2] == result.messages[2]  # the regenerated first reply, not the dataset's
    assert all("DATASET" not in m["content"] for m in second)
    assert "DATASET" not in " ".join(m["content"] for m in result.messages)


@pytest.mark.slow  # ~14 s on 2 shared cores
def test_sampling_is_reproducible_and_independent_of_batching(model, tokenizer):
    settings = {"temperature": 1.0, "top_p": 0.9, "seed": 7}
    batched = _generator(model, tokenizer, **settings).regenerate(list(enumerate(CONVERSATIONS)))
    again = _generator(model, tokenizer, **settings).regenerate(list(enumerate(CONVERSATIONS)))
    alone = [
        _generator(model, tokenizer, **settings).regenerate([(i, c)])[0] for i, c in enumerate(CONVERSATIONS)
    ]
    other = _generator(model, tokenizer, **{**settings, "seed": 8}).regenerate(list(enumerate(CONVERSATIONS)))
    assert [r.messages for r in batched] == [r.messages for r in again] == [r.messages for r in alone]
    assert [r.messages for r in batched] != [r.messages for r in other]


@pytest.mark.parametrize("engine", [True, False], ids=["slot-engine", "plain"])
def test_sampling_equals_a_plain_loop_with_the_same_turn_seeds(model, tokenizer, engine):
    settings = RegenConfig(temperature=0.8, top_k=20, top_p=0.95, seed=3, max_new_tokens=10)
    gen = TurnGenerator(model, tokenizer, settings, device="cpu", max_length=256, engine=engine)
    got = gen.regenerate(list(enumerate(CONVERSATIONS)))

    def pick_for(index):
        def for_turn(turn):
            g = torch.Generator().manual_seed(turn_seed(3, index, turn))
            return lambda logits, step: int(
                torch.multinomial(filtered_probs(logits, settings)[0], 1, generator=g)
            )

        return for_turn

    for i, (conv, result) in enumerate(zip(CONVERSATIONS, got, strict=True)):
        want = _plain_conversation(model, tokenizer, conv, 10, gen.end_ids, pick_for(i))
        assert result.messages == want[: len(result.messages)]


def test_filtered_probs_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = filtered_probs(logits, RegenConfig(temperature=1.0, top_p=0.8))
    assert torch.allclose(probs, torch.tensor([[0.5, 0.3, 0.0, 0.0]]))  # renormalised by multinomial
    assert filtered_probs(logits, RegenConfig(temperature=1.0, top_k=1))[0].tolist() == [1.0, 0, 0, 0]


def test_a_prompt_too_long_is_a_counted_failure_and_keeps_earlier_turns(model, tokenizer):
    long = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "word " * 200},
        {"role": "assistant", "content": "y"},
    ]
    gen = TurnGenerator(model, tokenizer, RegenConfig(max_new_tokens=4), device="cpu", max_length=64)
    (result,) = gen.regenerate([(5, long)])
    assert result.failed is not None and result.failed.reason == "prompt too long"
    assert result.failed.turn == 1 and result.failed.skipped_turns == 1
    assert result.turns == 1 and [m["role"] for m in result.messages] == ["user", "assistant"]


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"temperature": -0.1}, "regen.temperature must be >= 0"),
        ({"top_p": 0.0}, "regen.top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "regen.top_p must be in (0, 1]"),
        ({"max_new_tokens": 0}, "regen.max_new_tokens must be >= 1"),
        ({"batch_size": -1}, "regen.batch_size must be >= 0 (0: auto)"),
        ({"top_k": -1}, "regen.top_k must be >= 0"),
    ],
)
def test_bad_settings_are_clear_errors(settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        RegenConfig(**settings)


def test_a_flex_target_core_decodes_with_sdpa_and_keeps_its_feature_path(tokenizer):
    """TargetCore's packed flex attention needs a BlockMask: decoding switches the model to SDPA and back."""
    from dflash_pipe.target import TargetCore
    from dflash_pipe.target.packing import FLEX_ATTENTION

    config = tiny_qwen3_config(vocab_size=len(tokenizer), max_position_embeddings=512)
    torch.manual_seed(0)
    core = TargetCore(config, [0, 1], "cpu", torch.float32, attention="flex")
    reference = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    reference.load_state_dict(core.model.state_dict())
    ids = torch.arange(5, 45)
    before = core.features(ids, [10, 30]).clone()
    got = TurnGenerator(core.model, tokenizer, RegenConfig(max_new_tokens=6), device="cpu", max_length=256)
    want = TurnGenerator(reference, tokenizer, RegenConfig(max_new_tokens=6), device="cpu", max_length=256)
    items = list(enumerate(CONVERSATIONS))
    assert [r.messages for r in got.regenerate(items)] == [r.messages for r in want.regenerate(items)]
    assert core.model.config._attn_implementation == FLEX_ATTENTION
    assert torch.equal(core.features(ids, [10, 30]), before)


def test_an_empty_reply_is_a_counted_failure(tokenizer):
    """A target whose first token is always EOS (id 0 of the demo tokenizer): every turn fails as empty."""
    config = tiny_qwen3_config(vocab_size=len(tokenizer), max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="sdpa").eval()
    model.model.norm.weight.data.zero_()  # all logits 0: the argmax is token 0, <|endoftext|>
    assert tokenizer.convert_ids_to_tokens(0) == tokenizer.eos_token
    gen = _generator(model, tokenizer)
    results = gen.regenerate(list(enumerate(CONVERSATIONS)))
    assert all(r.turns == 0 and r.messages == [] for r in results)
    assert [(r.failed.reason, r.failed.turn, r.failed.skipped_turns) for r in results] == [
        ("empty reply", 0, 2),
        ("empty reply", 0, 1),
        ("empty reply", 0, 2),
    ]


@pytest.mark.parametrize("seeds", [None, [11, 12, 13, 14, 15]])
def test_rows_ending_early_leave_the_batch_and_change_nothing(model, tokenizer, seeds):
    """The plain path: rows with smaller limits end first and are compacted out of the batch (and its
    cache); each reply must equal that prompt decoded alone."""
    gen = _generator(model, tokenizer, engine=False, **({"temperature": 0.9} if seeds else {}))
    prompts = [list(range(5 + i, 20 + 3 * i)) for i in range(5)]
    limits = [3, 40, 9, 17, 25]
    sizes: list[int] = []
    forward = gen.plain._forward
    gen.plain._forward = lambda ids, *rest: sizes.append(ids.shape[0]) or forward(ids, *rest)
    batched = gen.generate(prompts, limits, seeds)
    gen.plain._forward = forward
    alone = [
        gen.generate([p], [n], None if seeds is None else [seeds[i]])[0]
        for i, (p, n) in enumerate(zip(prompts, limits, strict=True))
    ]
    assert [(r.tokens, r.ended) for r in batched] == [(r.tokens, r.ended) for r in alone]
    assert all(len(r.tokens) + r.ended <= n for r, n in zip(batched, limits, strict=True))
    assert sizes[0] == 5 and min(sizes) < 5  # finished rows left the batch


@pytest.mark.parametrize("engine", [True, False], ids=["engine", "plain"])
def test_replies_at_the_cap_and_in_a_loop_are_counted_and_drop_leaves_loops_out(model, tokenizer, engine):
    """The tiny random target often repeats itself (a greedy loop, as small real targets do). Each reply
    that ran to --max-new-tokens is counted as capped, each that ends in a loop as looped; "keep" keeps
    them, "drop" ends the conversation before its first looped reply (a failure with reason ``looped``)."""
    from dflash_pipe.data.loops import ends_in_loop

    items = list(enumerate(CONVERSATIONS))
    gen = _generator(model, tokenizer, engine, max_new_tokens=48)
    seen = []
    settle = gen._settle
    gen._settle = lambda state, reply, limit: seen.append((state.index, reply)) or settle(state, reply, limit)
    kept = gen.regenerate(items)
    capped = [i for i, r in seen if not r.ended and len(r.tokens) >= 48]
    looped = [i for i, r in seen if ends_in_loop(r.tokens)]
    assert looped and len(capped) > len(looped)  # the case is exercised: loops among the capped replies
    assert [r.capped for r in kept] == [capped.count(r.index) for r in kept]
    assert [r.looped for r in kept] == [looped.count(r.index) for r in kept]
    assert sum(r.turns for r in kept) == len(seen)  # kept: every reply is in the conversation
    dropped = _generator(model, tokenizer, engine, max_new_tokens=48, loops="drop").regenerate(items)
    for keep, drop in zip(kept, dropped, strict=True):
        if not keep.looped:
            assert drop.messages == keep.messages and drop.failed == keep.failed
            continue
        assert drop.looped == 1 and drop.failed is not None and drop.failed.reason == "looped"
        assert drop.turns == drop.failed.turn and drop.messages == keep.messages[: len(drop.messages)]
