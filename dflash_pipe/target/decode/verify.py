"""Speculative decoding's verify forward on the slot stack, one CUDA graph per attention span.

A verify forward is a block of ``block_size`` tokens of one sequence at consecutive positions; on the
stack it is one decode step whose rows are the block's tokens, all on the same cache row
(``DecodeStack.block_step``). Its shapes are the same at every step but the span, so each span (rounded up
to ``SPAN_QUANTUM``) is captured once and replayed: the ~40 kernels per layer of an 8B target cost one
launch instead of the host's time per kernel. Rolling back costs nothing: the next block is written from
the first rejected position on, and columns past a query's position are never read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dflash_pipe.target.decode.engine import SPAN_QUANTUM
from dflash_pipe.target.decode.slots import capture
from dflash_pipe.target.decode.stack import DecodeStack


class BlockVerifier:
    """One sequence's cache on ``stack`` and its verify step; graphs where the stack is graph safe on CUDA."""

    def __init__(self, stack: DecodeStack, block_size: int, feature_layers: Sequence[int]) -> None:
        self.stack, self.block_size = stack, block_size
        self.feature_layers = list(feature_layers)
        self.cache = stack.new_cache(1)
        dev = stack.device
        self._tokens = torch.zeros(block_size, dtype=torch.long, device=dev)
        self._positions = torch.zeros(block_size, dtype=torch.long, device=dev)
        self._rows = torch.zeros(block_size, dtype=torch.long, device=dev)  # every token on cache row 0
        self._offsets = torch.arange(block_size, device=dev)
        self.use_graphs = dev.type == "cuda" and stack.graph_safe
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool = None

    def prefill(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt written from position 0: logits after each token ``[P, V]``, features ``[P, k*H]``."""
        logits, features = self.stack.extend(self.cache, 0, ids, 0, self.feature_layers)
        assert features is not None
        return logits, features

    def verify(self, block: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``block`` ``[bs]`` written at ``start..start+bs-1``: the logits after each token ``[bs, V]`` and the
        features ``[bs, k*H]``. With graphs, both are the graph's own buffers: read them before the next
        call."""
        if block.numel() != self.block_size:
            raise ValueError(f"a verify block holds {self.block_size} tokens, got {block.numel()}")
        if start + self.block_size > self.stack.max_len:
            raise ValueError(
                f"a block at {start} runs past the stack's {self.stack.max_len} positions: build it longer"
            )
        self._tokens.copy_(block)
        self._positions.copy_(self._offsets + start)
        span = min(self.stack.max_len, math.ceil((start + self.block_size) / SPAN_QUANTUM) * SPAN_QUANTUM)
        if not self.use_graphs:
            return self._forward(span)
        graph, logits, features = self._graphs.get(span) or self._capture(span)
        graph.replay()
        return logits, features

    def _forward(self, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.stack.block_step(
            self.cache, self._rows, self._tokens, self._positions, span, self.feature_layers
        )

    def _capture(self, span: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        """Warms up on a side stream (first compiles, allocator), then captures. The warm-up writes the
        current block's keys where its replay writes them again: nothing to restore."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, (logits, features) = capture(lambda: self._forward(span), self._pool, warmups=1)
        self._graphs[span] = (graph, logits, features)
        return self._graphs[span]
