"""Continuous batching of conversations over a fixed set of slots, each turn extending its slot's cache.

A conversation holds one slot from its first turn to its last. When its turn ends, the next prompt (the
previous prompt + the reply + the next user turn, rendered and tokenized again by the caller) is compared
with what the slot's cache holds, and only the tokens after their common prefix are prefilled. When a
conversation has no turn left, its slot takes the next conversation at once. The host looks at the device
every ``check_every`` steps (one small copy); in between, the decode steps replay without it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dflash_pipe.target.decode.slots import SlotState, StepGraphs
from dflash_pipe.target.decode.stack import DecodeStack

SPAN_QUANTUM = 128
"""Attention spans are rounded up to a multiple of this (one captured graph per span)."""
PREFILL_TOKENS = 16384
"""Padded tokens per prefill call at most (longer rows still go alone)."""
CPU_PREFILL_TOKENS = 2048
"""The same off a GPU, where a call costs in proportion to its tokens (no launch overhead to share) and a
16K-token call of a 135M target takes a minute on two cores: a stop is heard between calls."""
PREFILL_GROUP = 8
"""A prefill waits until 1/8 of the slots have a turn to start (or ``PREFILL_WAIT`` checks have passed)."""
PREFILL_WAIT = 4
"""Checks (of ``check_every`` steps) a turn waits at most for others to share its prefill call."""


class GenerationStopped(Exception):
    """``should_stop`` said stop: the call returns nothing (the conversations are generated again later)."""


@dataclass(slots=True)
class TurnRequest:
    """One turn to generate: its whole prompt, its token limit and its sampling seed (None: greedy)."""

    prompt: list[int]
    max_new: int
    seed: int | None = None


class Session(Protocol):
    """A conversation as the engine sees it: the caller renders prompts and keeps the replies."""

    def next_request(self) -> TurnRequest | None:
        """The next turn to generate, None when the conversation has no turn left."""

    def take(self, tokens: list[int], end: int | None) -> None:
        """The turn's reply: its tokens without the end-of-turn token, and that token (None: the turn ran to
        its limit)."""


@dataclass(slots=True)
class EngineStats:
    """What one ``run`` did (for benches and the dashboard)."""

    turns: int = 0
    generated: int = 0
    """Tokens generated, end-of-turn tokens included."""
    prefilled: int = 0
    """Prompt tokens run through the model."""
    reused: int = 0
    """Prompt tokens found in the slot's cache already (not prefilled again)."""
    steps: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    prefill_calls: int = 0
    graphs: int = 0


@dataclass(slots=True)
class _Slot:
    session: Session | None = None
    request: TurnRequest | None = None
    cached: list[int] = field(default_factory=list)
    """The tokens whose keys and values the slot's cache holds, in order."""
    fed: int = 0
    """Upper bound of the next position written (for the attention span)."""
    generator: torch.Generator | None = None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SlotEngine:
    """Decodes turns of many conversations on ``slots`` rows of one static cache."""

    def __init__(
        self,
        stack: DecodeStack,
        *,
        slots: int,
        max_new: int,
        end_ids: list[int],
        greedy: bool,
        pick: Callable[[torch.Tensor, list[torch.Generator]], torch.Tensor] | None = None,
        check_every: int = 8,
        use_graphs: bool | None = None,
    ) -> None:
        """``pick(logits [S, V], generators)``: the sampled next token per slot (``greedy`` False)."""
        self.stack = stack
        self.cache = stack.new_cache(slots)
        self.state = SlotState(slots, max_new, end_ids, self.cache.trash, stack.device)
        if use_graphs is None:
            use_graphs = stack.device.type == "cuda" and stack.graph_safe
        self.steps = StepGraphs(stack, self.cache, self.state, use_graphs=use_graphs, greedy=greedy)
        self.greedy = greedy
        self._pick = pick
        self.check_every = check_every
        self.max_new = max_new
        self._slots = [_Slot() for _ in range(slots)]
        self._idle_generator = torch.Generator(device=stack.device)
        self._end_ids = set(end_ids)
        self._prefill_rows = max(1, slots // PREFILL_GROUP)
        self._rollback = getattr(stack, "rollback", True)
        """False for stacks with recurrent state (hybrids): a slot's cache is reused only when the next
        prompt extends all of it."""
        self.stats = EngineStats()

    @property
    def use_graphs(self) -> bool:
        return self.steps.use_graphs

    @property
    def slots(self) -> int:
        return len(self._slots)

    @torch.inference_mode()
    def run(
        self,
        sessions: Iterable[Session],
        should_stop: Callable[[], bool] | None = None,
        between: Callable[[], Iterable[Session]] | None = None,
    ) -> EngineStats:
        """Generates every turn of every session; returns what it did. ``should_stop`` is polled after each
        decode step and between prefill calls (host only, no wait for the device): True raises
        ``GenerationStopped`` (replies of unfinished turns are not delivered; finished ones were).
        ``between`` is called at each check too (the caller's other work: a producer computes the feature
        batches queued meanwhile) and returns more sessions, which take slots as they free up; the run
        ends when no session is left and ``between`` brings none."""
        stats = self.stats = EngineStats()
        t0 = time.perf_counter()
        waiting: deque[Session] = deque(sessions)
        pending: deque[int] = deque()  # slots whose next turn must be prefilled
        for slot in self._slots:  # a new run starts with empty slots
            slot.session, slot.request, slot.cached = None, None, []
        self._fill(waiting, pending, range(len(self._slots)))
        waited = 0  # checks the oldest pending turn has waited
        while True:
            if pending and self._prefill_due(pending, waited):
                self._prefill(pending, should_stop)
                waited = 0
            elif pending:
                waited += 1
            if not any(s.request is not None for s in self._slots):
                waiting.extend(between() if between is not None else ())
                if not waiting:
                    break
                self._fill(waiting, pending, range(len(self._slots)))
                continue
            span = self._span(pending)
            for _ in range(self.check_every):
                self.steps.run(span, self._sampler)
                if should_stop is not None and should_stop():
                    raise GenerationStopped
            stats.steps += self.check_every
            for index in self._decoding(pending):
                self._slots[index].fed += self.check_every
            if between is not None:
                waiting.extend(between())
            self._collect(waiting, pending)
        stats.seconds = time.perf_counter() - t0
        stats.graphs = self.steps.captured
        return stats

    # --- host side of the loop --------------------------------------------------------------------------

    def _sampler(self, logits: torch.Tensor) -> torch.Tensor:
        assert self._pick is not None
        gens = [s.generator or self._idle_generator for s in self._slots]
        return self._pick(logits, gens)

    def _prefill_due(self, pending: deque[int], waited: int) -> bool:
        """Whether to prefill now: when enough turns wait to fill one call, when nothing else decodes, or
        when the oldest has waited ``PREFILL_WAIT`` checks. A prefill call stops every slot's decoding for
        about as long as several steps, whatever its size, so turns that end one by one are taken in
        groups rather than each in a call of its own."""
        decoding = self._decoding(pending)
        return len(pending) >= self._prefill_rows or not decoding or waited >= PREFILL_WAIT

    def _decoding(self, pending: deque[int]) -> list[int]:
        """The slots whose turn has started (a turn waiting for its prefill has not)."""
        waiting = set(pending)
        return [i for i, s in enumerate(self._slots) if s.request is not None and i not in waiting]

    def _span(self, pending: deque[int]) -> int:
        """Attention columns the next ``check_every`` steps read: every live position stays below it."""
        need = max(self._slots[i].fed for i in self._decoding(pending)) + self.check_every
        return min(self.cache.max_len, math.ceil(need / SPAN_QUANTUM) * SPAN_QUANTUM)

    def _fill(self, waiting: deque[Session], pending: deque[int], slots: Iterable[int]) -> None:
        """Gives each idle slot of ``slots`` the next waiting conversation that has a turn to generate."""
        for index in slots:
            slot = self._slots[index]
            if slot.request is not None:
                continue
            slot.session, slot.cached = None, []
            while waiting:
                session = waiting.popleft()
                request = session.next_request()
                if request is not None:
                    slot.session, slot.request = session, request
                    pending.append(index)
                    break

    def _collect(self, waiting: deque[Session], pending: deque[int]) -> None:
        """Hands every ended turn to its session, queues the session's next turn in the same slot, and
        refills the slots whose conversation is over."""
        state = self.state
        done, count = torch.stack([state.done.long(), state.count]).tolist()  # waits for the device
        ended = [i for i in self._decoding(pending) if done[i]]
        if not ended:
            if waiting:  # sessions that arrived while every slot was busy: any idle slot takes them
                self._fill(waiting, pending, range(len(self._slots)))
            return
        rows = state.history[ended].tolist()
        for index, row in zip(ended, rows, strict=True):
            slot = self._slots[index]
            assert slot.session is not None and slot.request is not None
            tokens = row[: count[index]]
            self.stats.turns += 1
            self.stats.generated += len(tokens)
            slot.cached = slot.request.prompt + tokens[:-1]  # the last token picked was never fed
            if tokens and tokens[-1] in self._end_ids:
                slot.session.take(tokens[:-1], tokens[-1])
            else:
                slot.session.take(tokens, None)
            slot.request = slot.session.next_request()
            if slot.request is not None:
                pending.append(index)  # the same conversation's next turn, on its own cache
        self._fill(waiting, pending, range(len(self._slots)))  # ended conversations' slots take new ones

    def _prefill(self, pending: deque[int], should_stop: Callable[[], bool] | None = None) -> None:
        """Runs the new prompt tokens of every pending slot (in packed calls) and starts their turns;
        ``should_stop`` is polled between the calls."""
        t0 = time.perf_counter()
        work = []
        while pending:
            index = pending.popleft()
            slot = self._slots[index]
            assert slot.request is not None
            prompt = slot.request.prompt
            if slot.request.max_new > self.max_new or len(prompt) + slot.request.max_new > self.cache.max_len:
                raise ValueError(
                    f"a turn of {len(prompt)} prompt tokens + {slot.request.max_new} new does not fit the "
                    f"engine's {self.cache.max_len} positions / {self.max_new} new tokens per slot"
                )
            keep = min(_common_prefix(slot.cached, prompt), len(prompt) - 1)  # at least one token to run
            if not self._rollback and keep < len(slot.cached):
                keep = 0  # a recurrent state holds all of the cached tokens or none: start the slot over
            work.append((index, keep, prompt[keep:]))
            self.stats.reused += keep
            self.stats.prefilled += len(prompt) - keep
            slot.fed = len(prompt)
            slot.generator = None
            if slot.request.seed is not None:
                slot.generator = torch.Generator(device=self.stack.device).manual_seed(slot.request.seed)
        work.sort(key=lambda w: len(w[2]))
        budget = PREFILL_TOKENS if self.stack.device.type == "cuda" else CPU_PREFILL_TOKENS
        for group in _packs(work, budget):
            if should_stop is not None and should_stop():
                raise GenerationStopped
            slots = [w[0] for w in group]
            logits = self.stack.prefill(self.cache, slots, [w[2] for w in group], [w[1] for w in group])
            self.stats.prefill_calls += 1
            if self.greedy:
                first = logits.argmax(dim=-1)
            else:
                assert self._pick is not None
                gens = [self._slots[i].generator or self._idle_generator for i in slots]
                first = self._pick(logits, gens)
            dev = self.stack.device
            requests = [self._slots[i].request for i in slots]
            self.state.start(
                torch.as_tensor(slots, device=dev),
                first,
                torch.as_tensor([len(r.prompt) for r in requests], device=dev),
                torch.as_tensor([r.max_new for r in requests], device=dev),
            )
        self.stats.prefill_seconds += time.perf_counter() - t0


def _packs(
    work: list[tuple[int, int, list[int]]], budget: int = PREFILL_TOKENS
) -> Iterator[list[tuple[int, int, list[int]]]]:
    """Groups of prefill rows (sorted by length) whose padded size stays under ``budget`` tokens."""
    group: list[tuple[int, int, list[int]]] = []
    for item in work:
        if group and len(item[2]) * (len(group) + 1) > budget:
            yield group
            group = []
        group.append(item)
    if group:
        yield group
