"""Drafting through CUDA graphs: one captured draft step per bucket of context lengths.

Speculative decoding drafts one block at a time, at batch 1: five layers, the context projection and the
LM head over bs-1 rows are a few hundred small kernels. Launched one by one from Python they took 6.9 ms a
step on an H100 for SmolLM2-135M's drafter, more than the target's verify (docs/performance.md). Here each
step is the same forward (``draft_tokens``: ``block_hidden`` with SDPA and the training mask) captured
once per context bucket, a multiple of ``bucket`` tokens: a step copies the tokens and features into the
bucket's static buffers, sets the anchor, and replays. Rows past the context are never attended (the mask
shows a block the positions before its anchor), so the drafts are those of ``drafter_proposer``
(tests/drafter/test_graphed_draft.py). Opt-in (``evaluate_generate(graphs=True)``, the real-model bench's
``--draft-graphs on``) until a GPU run has timed and checked the capture.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .acceptance import draft_tokens
from .model import DFlashDrafter, Kernels

DRAFT_BUCKET = 128
"""Context lengths are rounded up to a multiple of this: one captured graph per multiple reached."""


def graphs_apply(drafter: DFlashDrafter) -> bool:
    """Whether a drafter's draft step can be captured: on CUDA, and with eager layers (a drafter a worker
    compiled for training runs Inductor's code, which is not captured here)."""
    return drafter.fc.weight.is_cuda and drafter.kernels == Kernels()


@dataclass(slots=True)
class _Step:
    """One bucket's static buffers and its draft step (a captured graph's replay, or the eager forward)."""

    ids: Tensor  # [1, L]
    features: Tensor  # [1, L, k*H]
    anchor: Tensor  # [1, 1]
    run: Callable[[], Tensor]  # -> draft [bs-1], in a buffer the next run of any bucket may overwrite


class GraphedProposer:
    """A ``Proposer`` (tokens [n+1], features [n, k*H] -> draft [bs-1]) that replays captured graphs.

    ``capture``: None captures on CUDA; False runs the same buffers eagerly (what CPU tests compare).
    Graphs share one memory pool; the inputs live outside it, one set per bucket."""

    def __init__(self, drafter: DFlashDrafter, *, bucket: int = DRAFT_BUCKET, capture: bool | None = None):
        if bucket < 1:
            raise ValueError(f"bucket must be >= 1, got {bucket}")
        self.drafter, self.bucket = drafter, bucket
        self.device = drafter.fc.weight.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"capture=True needs a drafter on CUDA, this one is on {self.device}")
        # RoPE's fp32 angles live on the CPU until a forward moves them; a capture cannot copy from the host
        drafter.inv_freq = drafter.inv_freq.to(self.device)
        self._steps: dict[int, _Step] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    def __call__(self, tokens: Tensor, features: Tensor) -> Tensor:
        n = features.shape[0]
        if tokens.shape[0] != n + 1:
            raise ValueError(
                f"tokens must be the n={n} verified tokens plus the block's first, got {tokens.shape[0]}"
            )
        length = math.ceil((n + 1) / self.bucket) * self.bucket
        step = self._steps.get(length) or self._build(length)
        step.ids[0, : n + 1].copy_(tokens)
        # rows from n on are never attended: zeros at first, an earlier context's (finite) features after
        step.features[0, :n].copy_(features)
        step.anchor.fill_(n)
        return step.run().clone()

    def _build(self, length: int) -> _Step:
        cfg, device = self.drafter.cfg, self.device
        dtype = self.drafter.fc.weight.dtype
        ids = torch.zeros(1, length, dtype=torch.long, device=device)
        features = torch.zeros(1, length, cfg.feature_size, dtype=dtype, device=device)
        anchor = torch.zeros(1, 1, dtype=torch.long, device=device)
        valid = torch.ones(1, 1, dtype=torch.bool, device=device)

        def forward() -> Tensor:
            with attending(self.drafter, "sdpa"):
                return draft_tokens(self.drafter, ids, features, anchor, valid)[0, 0]

        run = forward
        if self.capture:
            run = _captured(forward, self._pool)
        self._steps[length] = step = _Step(ids, features, anchor, run)
        return step


def _captured(forward: Callable[[], Tensor], pool) -> Callable[[], Tensor]:
    """``forward`` captured into a CUDA graph (after warm-up runs on a side stream, as PyTorch's docs ask):
    the returned function replays it and returns its output buffer."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with _no_autocast_cache():
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()

    def replay() -> Tensor:
        graph.replay()
        return out

    return replay


def _no_autocast_cache() -> contextlib.AbstractContextManager:
    """The caller's autocast without its cast cache: a cast cached before the capture would be read by the
    graph from memory the autocast frees when it exits (PyTorch's CUDA-graph notes ask for this)."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


@contextlib.contextmanager
def attending(drafter: DFlashDrafter, backend: str) -> Iterator[None]:
    """Within: ``drafter`` attends through ``backend`` (SDPA's dense mask is one kernel with static shapes;
    flex builds a BlockMask each step)."""
    before = drafter.cfg.attention_backend
    drafter.use_attention(backend)
    try:
        yield
    finally:
        drafter.use_attention(before)
