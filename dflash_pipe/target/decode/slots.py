"""The decode state of every slot on the device, and the one-token step that advances it.

A step feeds each slot's token, picks the next one, appends it to the slot's turn and decides whether the
turn ended (an end-of-turn token or its token limit), all as tensor operations on fixed shapes: no value
comes back to the host, so on CUDA the whole step (model included) replays as one captured graph
(``StepGraphs``). The host looks at ``done`` every few steps (``SlotEngine``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from dflash_pipe.target.decode.stack import DecodeStack, SlotCache

Picker = Callable[[torch.Tensor], torch.Tensor]
"""Logits ``[S, V]`` -> next token per slot ``[S]``."""
T = TypeVar("T")


def capture(fn: Callable[[], T], pool: Any, warmups: int) -> tuple[torch.cuda.CUDAGraph, T]:
    """``fn`` run ``warmups`` times on a side stream (allocator, cuBLAS handles, first compiles), then
    captured into a graph on ``pool``; returns the graph and what the captured call returned (its buffers).
    thread_local: the producer's other target threads keep working on their GPUs during a capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


class SlotState:
    """Per slot: the token to feed and where, the turn's tokens so far, its limit, and whether it ended."""

    def __init__(self, slots: int, max_new: int, end_ids: list[int], trash: int, device: torch.device):
        self.slots = slots
        self.max_new = max_new
        self.trash = trash
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)  # [S] fed next
        self.positions = torch.full((slots,), trash, dtype=torch.long, device=device)  # [S] where it goes
        self.count = torch.zeros(slots, dtype=torch.long, device=device)  # [S] tokens of the turn so far
        self.limit = torch.ones(slots, dtype=torch.long, device=device)  # [S]
        self.done = torch.ones(slots, dtype=torch.bool, device=device)  # [S] idle or ended
        self.history = torch.zeros(
            (slots, max_new + 1), dtype=torch.long, device=device
        )  # column max_new: trash
        self.end_ids = torch.as_tensor(end_ids, dtype=torch.long, device=device)
        self.rows = torch.arange(slots, device=device)

    def advance(self, picked: torch.Tensor) -> None:
        """Appends ``picked`` ``[S]`` to every live turn and moves it on (in place, capturable)."""
        live = ~self.done
        column = torch.where(live, self.count, self.max_new)
        self.history[self.rows, column] = picked
        self.count += live.long()
        is_end = (picked[:, None] == self.end_ids[None]).any(-1)
        self.done |= live & (is_end | (self.count >= self.limit))
        self.positions.copy_(torch.where(self.done, self.trash, self.positions + 1))
        self.tokens.copy_(picked)

    def start(self, slots: torch.Tensor, first: torch.Tensor, fed: torch.Tensor, limit: torch.Tensor) -> None:
        """Turns begin in ``slots`` ``[k]``: ``first`` ``[k]`` is their first token (picked from the prefill's
        logits), ``fed`` ``[k]`` the length their cache now holds, ``limit`` ``[k]`` their token limits."""
        self.history[slots, 0] = first
        self.count[slots] = 1
        self.limit[slots] = limit
        ended = (first[:, None] == self.end_ids[None]).any(-1) | (limit <= 1)
        self.done[slots] = ended
        self.positions[slots] = torch.where(ended, self.trash, fed)
        self.tokens[slots] = first


class StepGraphs:
    """One decode step over every slot, per attention span: captured CUDA graphs on CUDA, eager elsewhere.

    ``pick`` inside the graph must be greedy (argmax: deterministic, no host state); a sampling picker
    draws from per-turn ``torch.Generator``s on the host's schedule, so then only the model is captured
    and the pick and advance run eagerly after it."""

    def __init__(
        self,
        stack: DecodeStack,
        cache: SlotCache,
        state: SlotState,
        *,
        use_graphs: bool,
        greedy: bool,
    ) -> None:
        """The stack's own ``compile_layers`` decides whether its layers run compiled; either way the
        whole step (every layer, the pick and the advance) is captured as one graph per span."""
        self.stack, self.cache, self.state = stack, cache, state
        self.use_graphs = use_graphs
        self.greedy = greedy
        self.logits = torch.zeros((state.slots, stack.shape.vocab), dtype=torch.float32, device=stack.device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None

    def _model_step(self, span: int) -> None:
        s = self.state
        self.logits.copy_(self.stack.step(self.cache, s.tokens, s.positions, span))
        if self.greedy:
            s.advance(self.logits.argmax(dim=-1))

    def run(self, span: int, pick: Picker | None = None) -> None:
        """One step with attention over the first ``span`` positions of every slot."""
        if self.use_graphs:
            graph = self._graphs.get(span) or self._capture(span)
            graph.replay()
        else:
            self._model_step(span)
        if not self.greedy:
            assert pick is not None, "a sampled step needs a picker"
            self.state.advance(pick(self.logits))

    def _capture(self, span: int) -> torch.cuda.CUDAGraph:
        """Warms the step up on a side stream (allocator, cuBLAS handles, first compiles), then captures it.
        The warm-up steps run on real state: the slot state, and whatever the cache advances for good (a
        hybrid's recurrent states: ``snapshot``), are saved and restored around it."""
        s = self.state
        tensors = (s.tokens, s.positions, s.count, s.done, s.history)
        saved = [t.clone() for t in tensors]
        cache_saved = self.cache.snapshot() if hasattr(self.cache, "snapshot") else None
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, _ = capture(lambda: self._model_step(span), self._pool, warmups=2)
        for live, kept in zip(tensors, saved, strict=True):
            live.copy_(kept)
        if cache_saved is not None:
            self.cache.restore(cache_saved)
        self._graphs[span] = graph
        return graph

    @property
    def captured(self) -> int:
        return len(self._graphs)
