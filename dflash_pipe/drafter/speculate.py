"""Real DFlash speculative decoding (greedy), as it is served, and the greedy decoding it must equal.

One prompt at a time (batch 1), the way the reference `spec_generate` and the serving engines run a request:

1. the target prefills the prompt with a KV cache and emits its first token;
2. the drafter drafts a block ``[last token, MASK x (bs-1)]`` at the positions after the context, from the
   context features (target layers ``target_layer_ids``, ``hidden_states[id + 1]``) of every token the target
   has verified; it goes through ``DFlashDrafter.block_hidden`` (the training forward and masks, one anchor
   at the end of the context), so whatever layer types the drafter has are drafted as they were trained;
3. the target verifies the whole block in one forward on its cache; the longest prefix of draft tokens that
   equals the target's greedy choices is accepted, plus the target's own next token (the bonus);
4. the target cache is rolled back to the verified length (HF's ``crop``; on the slot engine's stack, which
   serves the dense families, the next block simply overwrites the rejected positions), the accepted
   tokens' features join the context, and it repeats until an end-of-turn token or ``max_new_tokens``.

The drafter recomputes its context keys each step instead of caching them (same result, more drafter work:
the cost is counted in `SpecOutput`). Acceptance is counted as the DFlash reference counts it: tokens
produced per draft-verify step, bonus included (``tau``); per draft position, the steps that kept it.
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .acceptance import AcceptanceCounts, draft_tokens
from .model import DFlashDrafter

Proposer = Callable[[Tensor, Tensor], Tensor]
"""(tokens [n+1] (the last is the block's first token), context features [n, k*H]) -> draft [bs-1]."""


class LosslessError(AssertionError):
    """Speculative decoding produced other tokens than the target's plain greedy decoding."""


class CacheCropError(RuntimeError):
    """The target's KV cache cannot be cut back to the verified length (e.g. recurrent layers)."""


@dataclass(slots=True)
class SpecOutput:
    """One prompt's speculative decoding: the new tokens, how they were accepted, what it cost."""

    tokens: list[int]
    """Generated tokens (the prefill's first token included), ending at the end-of-turn token if one came."""
    counts: AcceptanceCounts
    """anchors = draft-verify steps, accepted_total = draft tokens kept; ``counts.tau`` is the DFlash tau."""
    target_forwards: int
    drafter_forwards: int
    seconds: float
    prefill_seconds: float
    per_step: list[int] = field(default_factory=list)
    """Tokens produced by each step (accepted drafts + the bonus), as the reference's acceptance_lengths."""
    propose_seconds: float = 0.0
    """Wall time in the drafter's proposals (synchronised), of ``seconds``."""
    verify_seconds: float = 0.0
    """Wall time in the target's verify forwards (synchronised), of ``seconds``."""

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def accepted_length(draft: Sequence[int], target_greedy: Sequence[int]) -> int:
    """Greedy acceptance: how many leading draft tokens equal the target's choices. draft, target_greedy
    [bs-1] token ids, read from the device once a step (a read per token would wait on the GPU each time):
    draft[i] is accepted when it and every draft token before it match target_greedy."""
    accepted = 0
    for drafted, chosen in zip(draft, target_greedy, strict=True):
        if drafted != chosen:
            break
        accepted += 1
    return accepted


def context_features(hidden_states: Sequence[Tensor], layer_ids: Sequence[int]) -> Tensor:
    """HF ``hidden_states`` (embeddings first) -> [B, T, k*H]: outputs of decoder layers ``layer_ids``."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def drafter_proposer(drafter: DFlashDrafter) -> Proposer:
    """The DFlash drafter as a proposer: one block anchored at the end of the context, greedy draft tokens."""
    device = drafter.fc.weight.device

    def propose(tokens: Tensor, features: Tensor) -> Tensor:
        n = features.shape[0]
        padded = torch.cat([features, features.new_zeros(1, features.shape[1])])  # row n: never attended
        anchors = torch.tensor([[n]], device=device)
        valid = torch.ones(1, 1, dtype=torch.bool, device=device)
        draft = draft_tokens(drafter, tokens[None].to(device), padded[None].to(device), anchors, valid)
        return draft[0, 0]  # [bs-1]

    return propose


def _cache_argument(target: nn.Module) -> str:
    """The forward's KV-cache keyword: ``cache`` on newer transformers 5 releases, ``past_key_values`` before
    (a feature check, not a version string)."""
    params = inspect.signature(type(target).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _returned_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _crop(cache, length: int) -> None:
    """Cut ``cache`` back to ``length`` tokens with HF's public API: ``crop(-n)`` removes n tokens on every
    transformers 5 release (a positive argument means an absolute length on older ones, an error on newer)."""
    remove = cache.get_seq_length() - length
    try:
        if remove > 0:
            cache.crop(-remove)
    except (RuntimeError, ValueError) as exc:  # NotImplementedError is a RuntimeError
        raise CacheCropError(
            f"the target's KV cache ({type(cache).__name__}) cannot be cropped ({type(exc).__name__}: {exc}), "
            "so real speculative decoding cannot run on this target; use the simulated tau"
        ) from exc
    if cache.get_seq_length() != length:
        raise CacheCropError(
            f"the target's KV cache ({type(cache).__name__}) holds {cache.get_seq_length()} tokens after "
            f"cropping to {length}: this target's cache cannot be rolled back (recurrent or sliding-window "
            "layers past their window), so real speculative decoding cannot run on it; use the simulated tau"
        )


class _HFTarget:
    """The target's own forward with its own KV cache, rolled back by ``crop`` (any family)."""

    def __init__(self, target: nn.Module, layer_ids: Sequence[int]) -> None:
        self.target, self.layer_ids = target, layer_ids
        self.cache_arg = _cache_argument(target)
        self.cache: Any = None

    def prefill(self, ids: Tensor) -> tuple[int, Tensor]:
        out = self.target(
            input_ids=ids[None], use_cache=True, output_hidden_states=True, logits_to_keep=1, return_dict=True
        )
        self.cache = _returned_cache(out)
        return int(out.logits[0, -1].argmax()), context_features(out.hidden_states, self.layer_ids)[0]

    def verify(self, block: Tensor, start: int) -> tuple[Tensor, Tensor]:
        out = self.target(
            input_ids=block[None],
            **{self.cache_arg: self.cache},
            use_cache=True,
            output_hidden_states=True,
            return_dict=True,
        )
        self.cache = _returned_cache(out)
        return out.logits[0].argmax(-1), context_features(out.hidden_states, self.layer_ids)[0]

    def keep(self, length: int) -> None:
        _crop(self.cache, length)


class _SlotTarget:
    """The target on the slot engine's stack: one slot, each block verified as one decode step (a CUDA graph
    per span on the GPU), so rolling back costs nothing (the rejected positions are overwritten by the next
    block and never read before)."""

    def __init__(self, verifier: Any) -> None:
        self.verifier = verifier

    def prefill(self, ids: Tensor) -> tuple[int, Tensor]:
        logits, features = self.verifier.prefill(ids.tolist())
        return int(logits[-1].argmax()), features

    def verify(self, block: Tensor, start: int) -> tuple[Tensor, Tensor]:
        logits, features = self.verifier.verify(block, start)
        return logits.argmax(-1), features.clone()  # the graph's buffers are rewritten by the next block

    def keep(self, length: int) -> None:
        pass


_KEPT_VERIFIER = "_dflash_pipe_block_verifier"
"""The target's attribute (suffixed by the block size) holding the last verifier built for it: the next
prompt reuses its stack, cache
and captured graphs when they are long enough and verify the same blocks and feature layers. (An attribute,
not a weak-keyed table: the verifier refers to the target, and the collector frees such a cycle.)"""

VERIFIER_LENGTH_QUANTUM = 1024
"""A verifier is built for a multiple of this many positions, so prompts of similar lengths share it."""


def _verifier(
    target: nn.Module, layer_ids: Sequence[int], max_len: int, engine: bool, block_size: int
) -> _HFTarget | _SlotTarget:
    """The slot engine's stack where the target's family has one (docs/data.md lists them), else HF's
    forward. One verifier is kept per block size (speculative decoding's and greedy decoding's, size 1)."""
    if engine:
        from dflash_pipe.target.decode import DecodeStack, unsupported_reason
        from dflash_pipe.target.decode.verify import BlockVerifier

        if unsupported_reason(target) is None:
            attr = f"{_KEPT_VERIFIER}_{block_size}"
            kept = getattr(target, attr, None)
            fits = kept is not None and kept.stack.max_len >= max_len
            if not (fits and kept.feature_layers == list(layer_ids)):
                length = math.ceil(max_len / VERIFIER_LENGTH_QUANTUM) * VERIFIER_LENGTH_QUANTUM
                kept = BlockVerifier(DecodeStack(target, max_len=length), block_size, layer_ids)
                setattr(target, attr, kept)
            return _SlotTarget(kept)
    return _HFTarget(target, layer_ids)


@torch.inference_mode()
def speculative_generate(
    target: nn.Module,
    propose: Proposer,
    prompt: Tensor,
    *,
    layer_ids: Sequence[int],
    block_size: int,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    engine: bool = True,
) -> SpecOutput:
    """Greedy DFlash speculative decoding of ``prompt`` [P] (int64) with an HF causal LM ``target``.

    ``propose`` drafts bs-1 tokens (``drafter_proposer``); ``layer_ids`` are the target layers whose outputs
    feed it. Stops after an end-of-turn token (``stop_ids``, kept in the output) or ``max_new_tokens``.
    ``engine``: verify on the slot engine's stack where the family has one (False: always HF's forward).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError(
            f"prompt must be a non-empty 1-D tensor of token ids, got shape {tuple(prompt.shape)}"
        )
    device = next(target.parameters()).device
    stop = set(int(t) for t in stop_ids)
    ids = prompt.to(device, torch.long)
    verifier = _verifier(target, layer_ids, ids.numel() + max_new_tokens + block_size, engine, block_size)
    _sync(device)
    t0 = time.perf_counter()
    first, features = verifier.prefill(ids)  # features [P, k*H]
    tokens = [first]
    _sync(device)
    prefill_s = time.perf_counter() - t0
    counts = AcceptanceCounts.zeros(block_size)
    per_step: list[int] = []
    drafter_forwards = 0
    propose_s = verify_s = 0.0
    while len(tokens) < max_new_tokens and tokens[-1] not in stop:
        n = features.shape[0]  # verified tokens; tokens[-1] sits at position n
        context = torch.cat([ids, torch.tensor(tokens, device=device)])  # [n+1]
        t_step = time.perf_counter()
        draft = propose(context, features).to(device)  # [bs-1]
        _sync(device)
        t_drafted = time.perf_counter()
        drafter_forwards += 1
        block = torch.cat([context[-1:], draft])  # [bs] at positions n..n+bs-1
        greedy, block_features = verifier.verify(block, n)  # [bs]: the target's token after each position
        _sync(device)
        propose_s += t_drafted - t_step
        verify_s += time.perf_counter() - t_drafted
        draft_ids, greedy_ids = draft.tolist(), greedy.tolist()
        accepted = accepted_length(draft_ids, greedy_ids[:-1])
        produced = draft_ids[:accepted] + [greedy_ids[accepted]]
        keep = len(produced)
        for i, t in enumerate(produced):
            if t in stop:
                keep = i + 1
                break
        keep = min(keep, max_new_tokens - len(tokens))
        tokens += produced[:keep]
        # the block positions n..n+keep-1 held verified tokens: their features join the context
        features = torch.cat([features, block_features[:keep]])
        verifier.keep(n + keep)
        counts.anchors += 1
        counts.accepted_total += keep - 1
        counts.per_slot_accepted[1:keep] += 1
        per_step.append(keep)
    _sync(device)
    return SpecOutput(
        tokens=tokens,
        counts=counts,
        target_forwards=1 + len(per_step),
        drafter_forwards=drafter_forwards,
        seconds=time.perf_counter() - t0,
        prefill_seconds=prefill_s,
        per_step=per_step,
        propose_seconds=propose_s,
        verify_seconds=verify_s,
    )


@dataclass(slots=True)
class GreedyOutput:
    tokens: list[int]
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


@torch.inference_mode()
def greedy_generate(
    target: nn.Module, prompt: Tensor, *, max_new_tokens: int, stop_ids: Sequence[int] = ()
) -> GreedyOutput:
    """The target's own greedy decoding, by HF ``generate(do_sample=False)``: the independent reference that
    speculative decoding must reproduce token for token."""
    device = next(target.parameters()).device
    ids = prompt.to(device, torch.long)[None]
    stops = [int(t) for t in stop_ids]
    pad = stops[0] if stops else 0
    _sync(device)
    t0 = time.perf_counter()
    # Exactly these stops and nothing else: a copy of the model's generation config, its eos replaced, its
    # sampling settings cleared (a checkpoint's generation_config.json often asks for top-p sampling). With
    # no stops, the eos is an id past the LM head's rows (no logit can pick it): None would mean "the model's".
    never = [int(target.get_output_embeddings().weight.shape[0])]
    config = copy.deepcopy(target.generation_config)
    config.update(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=stops or never,
        pad_token_id=pad,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    config.max_length = None
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    _sync(device)
    return GreedyOutput(tokens=out[0, ids.shape[1] :].tolist(), seconds=time.perf_counter() - t0)


def stack_greedy_generate(
    target: nn.Module,
    prompt: Tensor,
    *,
    layer_ids: Sequence[int],
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    engine: bool = True,
) -> GreedyOutput:
    """The target's greedy decoding on the stack ``speculative_generate`` verifies on: the same loop with
    blocks of one token and nothing drafted, so it pays what speculative decoding pays per target forward
    (a CUDA graph per span on the GPU, the same bookkeeping): the speedup's baseline. HF ``generate``
    (``greedy_generate``) stays the lossless reference: it runs the model's own code, but pays Python's time
    per layer at every token, which no server pays."""
    nothing = torch.empty(0, dtype=torch.long)
    out = speculative_generate(
        target,
        lambda tokens, features: nothing,
        prompt,
        layer_ids=layer_ids,
        block_size=1,
        max_new_tokens=max_new_tokens,
        stop_ids=stop_ids,
        engine=engine,
    )
    return GreedyOutput(tokens=out.tokens, seconds=out.seconds)


def check_lossless(spec: Sequence[int], greedy: Sequence[int], *, where: str = "prompt") -> None:
    """Raises `LosslessError` naming the first differing position unless the two are the same tokens."""
    if list(spec) == list(greedy):
        return
    first = next((i for i, (a, b) in enumerate(zip(spec, greedy, strict=False)) if a != b), None)
    if first is None:
        first = min(len(spec), len(greedy))
    raise LosslessError(
        f"{where}: speculative decoding is not lossless: it produced {len(spec)} tokens, greedy decoding "
        f"{len(greedy)}; first difference at new token {first} (speculative {list(spec[first : first + 5])}, "
        f"greedy {list(greedy[first : first + 5])}). A bug in the draft/verify loop, or (bf16 on a GPU) two "
        "near-tied logits that the block forward and the one-token forward round differently"
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
