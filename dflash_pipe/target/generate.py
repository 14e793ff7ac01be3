"""Regenerate assistant turns with the target: batched decoding with a KV cache, turn by turn.

Knows models, tokenizers and tensors (no files, queues or threads: the producer and ``dflash-pipe
regenerate`` wrap it). ``TurnGenerator.regenerate`` takes conversations and returns them as the target
answers them: for assistant turn k of every conversation in the batch, the prompt is the chat-template
rendering of the conversation so far *with the turns already regenerated* (plus the generation prompt), all
prompts of the round are decoded together (left padded, one KV cache), and each reply ends at the first
end-of-turn token (the template's turn terminator and the model's EOS ids) or at the token limit.

Decoding runs on the slot engine (``target.decode``) when the target's family is one it serves: a static
cache of ``batch_size`` slots (auto: as many as fit in free memory), the decode step captured in a CUDA
graph, a conversation's slot taking the next conversation as soon as its last turn ends, and turn k+1
prefilling only what follows turn k's cache.
Other families decode in rounds with a plain loop over the model's own forward (its own cache: hybrid and
sliding-window targets get theirs), announced by one log line. On both paths nothing of the checkpoint's
``generation_config`` (repetition penalties, default top-k) changes what is generated, and sampling draws
from one ``torch.Generator`` per (conversation, turn) seeded from (seed, index, turn): a turn's tokens do
not depend on which other conversations share its batch or on where a resumed run starts.

The jobs are split: this module builds each turn's prompt and settles its reply into the conversation
(``target.conversation``); the plain path's decoding is ``target.plain_decode``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dflash_pipe.data.config import RegenConfig
from dflash_pipe.data.loops import ends_in_loop
from dflash_pipe.data.regenerated import Regenerated
from dflash_pipe.data.render import render_prompt
from dflash_pipe.target.conversation import Conversation, turn_seed
from dflash_pipe.target.decode import EngineStats, SlotEngine, TurnRequest
from dflash_pipe.target.decode.sizing import FALLBACK_SLOTS, FREE_SHARE, auto_slots
from dflash_pipe.target.plain_decode import PlainDecoder, Reply

log = logging.getLogger("dflash_pipe.target")


def end_of_turn_ids(
    tokenizer: Any, generation_config: Any = None, template_kwargs: dict | None = None
) -> list[int]:
    """The tokens that end an assistant turn: the chat template's terminator (the special token the template
    writes right after an assistant message: ``<|im_end|>``, ``<|eot_id|>``, ...), the model's
    ``generation_config.eos_token_id`` (one or a list) and the tokenizer's EOS."""
    ids: list[int] = []
    eos = getattr(generation_config, "eos_token_id", None)
    ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    probe = "\x00dflash-probe\x00"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}],
            tokenize=False,
            **(template_kwargs or {}),
        )
    except Exception:  # a template without assistant turns of this shape: the EOS ids must do
        text = ""
    if probe in text:
        after = text.split(probe, 1)[1]
        first = tokenizer(after, add_special_tokens=False)["input_ids"][:1]
        special = set(getattr(tokenizer, "all_special_ids", [])) | set(
            getattr(tokenizer, "added_tokens_decoder", {})
        )
        if first and first[0] in special:
            ids.append(int(first[0]))
    out = list(dict.fromkeys(int(i) for i in ids))
    if not out:
        raise ValueError(
            "cannot tell where the target's turns end: its tokenizer has no EOS token, its generation_config "
            "no eos_token_id, and its chat template writes no special token after an assistant message. Set "
            "eos_token_id in the model's generation_config.json"
        )
    return out


class TurnGenerator:
    """Batched, KV-cached regeneration of assistant turns with one causal LM."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        settings: RegenConfig,
        *,
        device: torch.device | str,
        max_length: int,
        template_kwargs: dict[str, Any] | None = None,
        engine: bool = True,
        memory_share: float = FREE_SHARE,
    ) -> None:
        """``max_length``: the longest sample trained (data.max_length); a turn is generated only while its
        prompt leaves room under it, and no longer than that room. ``engine``: False always decodes on the
        plain path (benches compare the two). ``memory_share``: of the device's free memory, what an auto
        ``batch_size`` (0) may fill with slots (``target.decode.sizing``)."""
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings
        self.device = torch.device(device)
        self.max_length = max_length
        self.template_kwargs = dict(template_kwargs or {})
        self.end_ids = end_of_turn_ids(
            tokenizer, getattr(model, "generation_config", None), self.template_kwargs
        )
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.end_ids[0]
        self.plain = PlainDecoder(
            model, settings, device=self.device, end_ids=self.end_ids, pad_id=self.pad_id
        )
        """The decoding of families the slot engine does not serve (and of ``engine=False``)."""
        self._want_engine = engine
        self._memory_share = memory_share
        self._engine: SlotEngine | None = None
        self._engine_checked = False
        self.engine_stats = EngineStats()
        """What the slot engine did in the last call (empty on the plain path)."""

    def engine(self) -> SlotEngine | None:
        """The slot engine for this target (built on first use), None when its family decodes on the plain
        path (said once, in the log)."""
        if self._engine_checked:
            return self._engine
        self._engine_checked = True
        if not self._want_engine or self.settings.decoder == "plain":
            return None
        from dflash_pipe.target.decode.choose import build_stack, engine_refusal

        reason = engine_refusal(self.model, self.settings.decoder)
        if reason is not None and self.settings.decoder == "engine":
            raise ValueError(
                f"--regen-decoder engine: {type(self.model).__name__} cannot be decoded by the slot engine "
                f"because {reason}; use --regen-decoder auto (the plain path for it) or plain"
            )
        if reason is not None:
            log.warning(
                "regeneration: %s decodes on the plain path (HF forward per step, slower) because %s",
                type(self.model).__name__,
                reason,
            )
            return None
        stack = build_stack(self.model, self.max_length)
        slots = self.settings.batch_size
        if not slots:
            sizing = auto_slots(stack, share=self._memory_share)
            log.info("regeneration on %s: %s", stack.device, sizing.why)
            slots = sizing.slots
        self._engine = SlotEngine(
            stack,
            slots=slots,
            max_new=self.max_length,  # generate() may ask more than settings.max_new_tokens
            end_ids=self.end_ids,
            greedy=self.settings.greedy,
            pick=self.plain.pick,
        )
        return self._engine

    @property
    def batch_size(self) -> int:
        """Conversations this generator decodes together: its engine's slots, or the settings' batch on the
        plain path (auto there: ``FALLBACK_SLOTS``). Builds the engine on first use."""
        engine = self.engine()
        if engine is not None:
            return engine.slots
        return self.settings.batch_size or FALLBACK_SLOTS

    def regenerate(
        self,
        items: Sequence[tuple[int, list[dict[str, str]]]],
        should_stop: Callable[[], bool] | None = None,
        on_done: Callable[[Regenerated], None] | None = None,
        between: Callable[[], Sequence[tuple[int, list[dict[str, str]]]]] | None = None,
    ) -> list[Regenerated]:
        """``items``: (index, messages) per conversation. Every assistant turn is replaced by the target's
        reply (on the slot engine, each conversation as fast as its own turns go; on the plain path in
        rounds: round k decodes the k-th assistant turn of every conversation still going). A turn that
        cannot be generated ends its conversation there (``Regenerated.failed``). ``should_stop`` is polled
        between decode steps: True raises ``GenerationStopped`` (a producer shutting down). ``on_done``
        gets each conversation as soon as its last turn is decoded (the plain path: at the end of the round
        that decoded it), so a stop loses only the conversations still going.
        ``between`` (slot engine only; the plain path never calls it) runs at each of the engine's checks
        and returns more conversations, generated in the same call as slots free up."""
        states = [Conversation(index, messages) for index, messages in items]
        engine = self.engine()
        if engine is not None:

            def more() -> list[_TurnSession]:
                assert between is not None
                added = [Conversation(index, messages) for index, messages in between()]
                states.extend(added)
                return [_TurnSession(self, s, on_done) for s in added]

            sessions = [_TurnSession(self, s, on_done) for s in states]
            self.engine_stats = engine.run(sessions, should_stop, more if between is not None else None)
            return [s.result() for s in states]
        reported: set[int] = set()
        while True:
            round_ = []
            for n, state in enumerate(states):
                if state.advance():
                    round_.append(state)
                elif on_done is not None and n not in reported:
                    reported.add(n)
                    on_done(state.result())
            if not round_:
                break
            asking = [(s, r) for s in round_ if (r := self._request(s)) is not None]
            if not asking:
                continue
            requests = [r for _, r in asking]
            seeds = None if self.settings.greedy else [r.seed for r in requests]
            replies = self.plain.generate(
                [r.prompt for r in requests], [r.max_new for r in requests], seeds, should_stop
            )
            for (state, request), reply in zip(asking, replies, strict=True):
                self._settle(state, reply, request)
        return [s.result() for s in states]

    def _request(self, state: Conversation) -> TurnRequest | None:
        """The turn ``state`` is at, as the engine takes it (None: it cannot be generated; ``state`` says why)."""
        prompt = self._prompt(state)
        if prompt is None:
            return None
        room = min(self.settings.max_new_tokens, self.max_length - len(prompt))
        seed = None if self.settings.greedy else turn_seed(self.settings.seed, state.index, state.turn)
        return TurnRequest(prompt=prompt, max_new=room, seed=seed)

    def _settle(self, state: Conversation, reply: Reply, request: TurnRequest) -> None:
        """Writes a decoded turn into its conversation, as text and as the ids the target read and wrote
        (counted as capped and looped where it is: a looped one ends the conversation instead with
        ``regen.loops`` "drop")."""
        text = self.tokenizer.decode(reply.tokens, skip_special_tokens=False)
        if not text.strip():
            state.fail("empty reply")
            return
        new_tokens = len(reply.tokens) + int(reply.ended)
        capped = not reply.ended and len(reply.tokens) >= self.settings.max_new_tokens
        state.capped += int(capped)
        if ends_in_loop(reply.tokens):
            state.looped += 1
            if self.settings.loops == "drop":
                state.new_tokens += new_tokens
                state.fail("looped")
                return
        state.answer(text, new_tokens, truncated=not reply.ended)
        state.answered_ids(request.prompt, reply.tokens, reply.end)
        if not reply.ended and request.max_new < self.settings.max_new_tokens:
            state.stop_at_length()  # the sample is full: later turns would be cut off anyway

    def _prompt(self, state: Conversation) -> list[int] | None:
        try:
            text = render_prompt(self.tokenizer, state.out, self.template_kwargs)
        except Exception:  # jinja2 errors (raise_exception in templates), KeyError, TypeError, ...
            state.fail("template error")
            return None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= self.max_length:
            state.fail("prompt too long")
            return None
        return ids

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new: Sequence[int],
        seeds: Sequence[int] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Reply]:
        """One reply per prompt (single turns): on the slot engine when the family has one, else
        ``PlainDecoder.generate``. ``seeds``: None decodes greedily, else one sampling seed per prompt."""
        engine = self.engine()
        if engine is None:
            return self.plain.generate(prompts, max_new, seeds, should_stop)
        sessions = [
            _OneTurn(TurnRequest(list(p), int(n), None if seeds is None else int(seeds[i])))
            for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))
        ]
        self.engine_stats = engine.run(sessions, should_stop)
        return [s.reply for s in sessions]


class _OneTurn:
    """A single prompt as an engine session (``TurnGenerator.generate``)."""

    def __init__(self, request: TurnRequest) -> None:
        self._request: TurnRequest | None = request
        self.reply = Reply(tokens=[])

    def next_request(self) -> TurnRequest | None:
        request, self._request = self._request, None
        return request

    def take(self, tokens: list[int], end: int | None) -> None:
        self.reply = Reply(tokens, end)


class _TurnSession:
    """A conversation as an engine session: its turns' prompts and what their replies become."""

    def __init__(
        self,
        generator: TurnGenerator,
        state: Conversation,
        on_done: Callable[[Regenerated], None] | None = None,
    ) -> None:
        self.generator = generator
        self.state = state
        self.on_done = on_done
        self._request: TurnRequest | None = None

    def next_request(self) -> TurnRequest | None:
        while self.state.advance():
            request = self.generator._request(self.state)
            if request is not None:
                self._request = request
                return request
        if self.on_done is not None:
            self.on_done(self.state.result())
        return None

    def take(self, tokens: list[int], end: int | None) -> None:
        assert self._request is not None
        self.generator._settle(self.state, Reply(tokens, end), self._request)
