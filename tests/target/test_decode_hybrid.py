"""The hybrid decode stack (Qwen3.5 / Qwen3.5-MoE, text and multimodal checkpoints) checked against HF's own
``generate``, token for token: prompts of different lengths prefilled together on some slots of a cache, then
one-token steps with the argmax fed back; a second turn that goes on from a slot's state while other slots
step; and the slot engine running two-turn conversations on it."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from dflash_pipe.target.decode import SlotEngine, TurnRequest
from dflash_pipe.target.decode.hybrid import HybridStack, hybrid_unsupported_reason
from tests.target import families
from tests.tiny_models import tiny_qwen3_config

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("fla") is not None,
        reason="with fla installed transformers sends CPU tensors to fla's Triton kernels",
    ),
    pytest.mark.usefixtures("one_thread"),
]

VOCAB = 128
MAX_LEN = 160
TOLERANCE = 1e-3
"""Largest logit difference allowed from HF's (logits have std ~1; fp32 differences are ~1e-5, a conv
window or a state lost is ~3e-2)."""
BUILDS = {
    "qwen3_5-text": (lambda v: families.qwen3_5_text(v, layers=8), None),  # attention before DeltaNet
    "qwen3_5-multimodal": (families.qwen3_5_multimodal, "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": (families.qwen3_5_moe, "Qwen3_5MoeForConditionalGeneration"),
    "qwen3_next": (families.qwen3_next, None),  # the in_proj_qkvz / in_proj_ba layout (qwen3_5 in 5.17)
}
PROMPTS = [
    [5, 9, 7, 3, 30],
    list(range(20, 86)),  # longer than one 64-token chunk of the chunked delta rule
    [11, 40, 50, 11, 12, 13, 14, 99, 98, 97, 3],
]


def _model(name: str) -> torch.nn.Module:
    """A tiny random ``name`` target, its weights drawn at unit gain (HF's init, std 0.02, leaves a model so
    close to linear that a lost conv window moves the logits by 1e-4 and no argmax)."""
    build, class_name = BUILDS[name]
    torch.manual_seed(0)
    kw = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    if class_name is None:
        model = AutoModelForCausalLM.from_config(build(VOCAB), **kw).eval()
    else:
        model = getattr(transformers, class_name)._from_config(build(VOCAB), **kw).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("conv1d.weight"):
                p.normal_(0, 0.5)
            elif "embed_tokens" in param_name:
                p.normal_(0, 1)
            elif p.dim() >= 2:
                p.normal_(0, 1 / math.sqrt(p.shape[-1]))
    model.generation_config.eos_token_id = None  # the reference runs its n tokens (no end-of-turn token)
    return model


@pytest.fixture(scope="module", params=sorted(BUILDS))
def model(request) -> torch.nn.Module:
    return _model(request.param)


def _hf(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """The reference: HF ``generate``, greedy, the prompt alone, exactly ``n`` new tokens, and the logits
    each was picked from ``[n, V]``."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float().cpu()


def _assert_as_hf(model: torch.nn.Module, prompt: list[int], *got: tuple[list[int], torch.Tensor]) -> None:
    """Each of ``got`` (tokens, the logits they were picked from) is what HF generates after ``prompt``."""
    expected, expected_logits = _hf(model, prompt, len(got[0][0]))
    for tokens, logits in got:
        assert tokens == expected
        assert (logits.cpu() - expected_logits).abs().max() < TOLERANCE


def _decode(
    stack: HybridStack, cache, rows: dict[int, tuple[list[int], int, int]]
) -> dict[int, tuple[list[int], torch.Tensor]]:
    """Greedy turns on the slots of ``rows`` (slot -> (new tokens, start, tokens to pick)), prefilled in one
    call; a slot that has its tokens goes idle (trash position) while the others step on, as in the engine.
    Per slot: the tokens picked and the logits they were picked from ``[n, V]``."""
    slots = list(rows)
    logits = stack.prefill(cache, slots, [rows[s][0] for s in slots], [rows[s][1] for s in slots])
    got = {s: [t] for s, t in zip(slots, logits.argmax(-1).tolist(), strict=True)}
    seen = {s: [logits[r]] for r, s in enumerate(slots)}
    tokens = torch.zeros(cache.slots, dtype=torch.long, device=stack.device)
    positions = torch.full((cache.slots,), cache.trash, device=stack.device)
    for s in slots:
        tokens[s] = got[s][0]
        positions[s] = rows[s][1] + len(rows[s][0])
    for _ in range(max(n for _, _, n in rows.values()) - 1):
        for s in slots:
            if len(got[s]) >= rows[s][2]:
                positions[s] = cache.trash
        logits = stack.step(cache, tokens, positions, MAX_LEN)
        picked = logits.argmax(-1)
        for s in slots:
            if positions[s] != cache.trash:
                got[s].append(int(picked[s]))
                seen[s].append(logits[s])
        tokens = picked
        positions = torch.where(positions == cache.trash, positions, positions + 1)
    return {s: (got[s], torch.stack(seen[s])) for s in slots}


@torch.inference_mode()
def test_greedy_decoding_equals_hf_generate_per_prompt(model):
    """Three prompts on slots 0, 2, 3 of four (slot 1 idle throughout), 8 tokens each."""
    assert hybrid_unsupported_reason(model) is None
    stack = HybridStack(model, MAX_LEN)
    cache = stack.new_cache(4)
    got = _decode(stack, cache, {slot: (p, 0, 8) for slot, p in zip((0, 2, 3), PROMPTS, strict=True)})
    for slot, prompt in zip((0, 2, 3), PROMPTS, strict=True):
        _assert_as_hf(model, prompt, got[slot])


@torch.inference_mode()
def test_a_second_turn_goes_on_from_the_slot_state(model):
    """Turn 1 of slot 1 ends after 4 tokens and the slot idles while slot 0 decodes 6 more; turn 2 then
    prefills only what follows what slot 1 holds (its last picked token and a new user turn), beside a
    fresh slot given the whole concatenated prompt: both equal HF generate on that prompt."""
    stack = HybridStack(model, MAX_LEN)
    cache = stack.new_cache(3)
    first, other, extra = PROMPTS[0], PROMPTS[2], [17, 18, 19, 3]
    turn1 = _decode(stack, cache, {1: (first, 0, 4), 0: (other, 0, 10)})
    _assert_as_hf(model, other, turn1[0])
    reply = turn1[1][0]
    held = len(first) + len(reply) - 1  # the last picked token was never fed
    assert int(cache.length[1]) == held
    whole = first + reply + extra
    turn2 = _decode(stack, cache, {1: (reply[-1:] + extra, held, 8), 2: (whole, 0, 8)})
    _assert_as_hf(model, whole, turn2[1], turn2[2])


@torch.inference_mode()
def test_a_prefill_that_would_roll_a_slot_back_is_refused(model):
    stack = HybridStack(model, MAX_LEN)
    cache = stack.new_cache(2)
    stack.prefill(cache, [0], [PROMPTS[0]], [0])
    with pytest.raises(ValueError, match="cannot be rolled back"):
        stack.prefill(cache, [0], [[4, 5]], [2])
    with pytest.raises(NotImplementedError, match="rolled back"):
        stack.extend(cache, 0, [4, 5], 2)
    assert stack.rollback is False


@torch.inference_mode()
def test_a_snapshot_undoes_warm_up_steps():
    """A CUDA graph capture warms the step up on live state first: ``snapshot``/``restore`` undo what those
    steps advanced, so the next step gives what it would have given without them."""
    stack = HybridStack(_model("qwen3_5-text"), MAX_LEN)
    assert stack.graph_safe and not HybridStack(_model("qwen3_5_moe"), MAX_LEN).graph_safe
    cache = stack.new_cache(2)
    logits = stack.prefill(cache, [0, 1], PROMPTS[:2], [0, 0])
    tokens = logits.argmax(-1)
    positions = torch.tensor([len(p) for p in PROMPTS[:2]])
    saved = cache.snapshot()
    first, second = (stack.step(cache, tokens, positions, MAX_LEN) for _ in range(2))
    assert not torch.allclose(first, second, atol=TOLERANCE)  # the second step saw the token twice
    cache.restore(saved)
    assert torch.equal(cache.length, positions)
    assert torch.equal(stack.step(cache, tokens, positions, MAX_LEN), first)
    assert torch.equal(cache.length, positions + 1)


class _Conversation:
    """Turns of growing prompts: each next prompt is the previous one, its reply and ``extra``."""

    def __init__(self, prompt: list[int], extras: list[list[int]], limit: int) -> None:
        self.prompt, self.extras, self.limit = prompt, list(extras), limit
        self.turns: list[tuple[list[int], list[int]]] = []  # (prompt, reply)

    def next_request(self) -> TurnRequest | None:
        if self.turns:
            if not self.extras:
                return None
            last_prompt, last_reply = self.turns[-1]
            self.prompt = last_prompt + last_reply + self.extras.pop(0)
        return TurnRequest(self.prompt, self.limit)

    def take(self, tokens: list[int], end: int | None) -> None:
        self.turns.append((self.prompt, tokens))


@torch.inference_mode()
def test_the_slot_engine_runs_conversations_on_the_hybrid_stack():
    """Three two-turn conversations on two slots: every turn equals HF generate on its prompt alone, and a
    second turn reuses its slot's state (it is prefilled from where the first turn ended)."""
    model = _model("qwen3_5-text")
    stack = HybridStack(model, MAX_LEN)
    engine = SlotEngine(stack, slots=2, max_new=16, end_ids=[-1], greedy=True, check_every=4)
    limits = [6, 9, 5]
    sessions = [_Conversation(p, [[17, 18, 3]], n) for p, n in zip(PROMPTS, limits, strict=True)]
    stats = engine.run(sessions)
    for session, limit in zip(sessions, limits, strict=True):
        assert len(session.turns) == 2
        for prompt, reply in session.turns:
            assert reply == _hf(model, prompt, limit)[0]
    assert stats.reused >= sum(len(p) + n - 1 for p, n in zip(PROMPTS, limits, strict=True))


def test_unsupported_models_are_named():
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=VOCAB))
    assert "model type 'qwen3'" in hybrid_unsupported_reason(dense)
    model = _model("qwen3_5-text")
    model.model.layers[0].linear_attn.activation = "gelu"
    assert "activation of layer 0" in hybrid_unsupported_reason(model)
    with pytest.raises(ValueError, match="cannot be decoded by the hybrid stack"):
        HybridStack(model, MAX_LEN)


def test_regeneration_decodes_hybrids_on_the_stack_by_default():
    """``--regen-decoder auto`` decodes a hybrid on this stack (replies equal HF generate, cut at the first
    end-of-turn token); ``plain`` keeps HF's forward; ``engine`` on a family the stack cannot take is an
    error naming why, not a silent fallback."""
    from dflash_pipe.data import demo_tokenizer
    from dflash_pipe.data.config import RegenConfig
    from dflash_pipe.target.generate import TurnGenerator

    model = _model("qwen3_5-text")

    def generator(decoder: str, target: torch.nn.Module = model) -> TurnGenerator:
        settings = RegenConfig(max_new_tokens=8, batch_size=2, decoder=decoder)
        return TurnGenerator(target, demo_tokenizer(), settings, device="cpu", max_length=MAX_LEN)

    assert generator("plain").engine() is None
    gen = generator("auto")
    assert isinstance(gen.engine().stack, HybridStack)
    for prompt, reply in zip(PROMPTS, gen.generate(PROMPTS, [8] * len(PROMPTS)), strict=True):
        want = _hf(model, prompt, 8)[0]
        cut = next((i for i, t in enumerate(want) if t in gen.end_ids), None)
        assert (reply.tokens, reply.ended) == ((want, False) if cut is None else (want[:cut], True))
    odd = _model("qwen3_5-text")
    odd.model.layers[0].linear_attn.activation = "gelu"
    with pytest.raises(ValueError, match="--regen-decoder engine: .* activation of layer 0"):
        generator("engine", odd).engine()
