"""Drafting through CUDA graphs: one captured draft step per bucket of context lengths.

Speculative decoding drafts one block at a time, at batch 1: five layers, the context projection and the
LM head over bs-1 rows are a few hundred small kernels. Launched one by one from Python they took 6.9 ms a
step on an H100 for SmolLM2-135M's drafter, more than the target's verify (docs/performance.md). Here each
step is the same forward (``draft_tokens``: ``block_hidden`` with SDPA and the training mask) captured
once per context bucket, a multiple of ``bucket`` tokens: a step copies the tokens and features into the
bucket's static buffers, sets the anchor, and replays. Rows past the context are never attended (the mask
shows a block the positions before its anchor), so the drafts are those of ``drafter_proposer``
(tests/drafter/test_graphed_draft.py). Opt-in (``evaluate_generate(graphs=True)``, the real-model bench's
``--draft-graphs on``): on an H100 the graphs cut SmolLM2-135M's draft step from 7.6 to 1.3 ms but drafted
other tokens than the forward (docs/performance.md). ``check=True`` finds where: every graphed draft is
compared with the step-by-step SDPA forward's once its sequence ends (so the graphs replay as they do
unchecked); a differing one is replayed again, run eagerly on the same buffers and from a graph captured
afresh, and the weights' addresses are compared with the capture's (the real-model bench's
``--draft-graphs check``).
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
from .speculate import drafter_proposer

DRAFT_BUCKET = 128
"""Context lengths are rounded up to a multiple of this: one captured graph per multiple reached."""
KEPT_MISMATCHES = 20
"""With ``check``: the first this many differing drafts are kept in full (all are counted)."""


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
    eager: Callable[[], Tensor]  # the same step on the same buffers, launched kernel by kernel
    addresses: dict[str, int]  # where each weight the step reads lived when it was built (a graph keeps them)


class GraphedProposer:
    """A ``Proposer`` (tokens [n+1], features [n, k*H] -> draft [bs-1]) that replays captured graphs.

    ``capture``: None captures on CUDA; False runs the same buffers eagerly (what CPU tests compare).
    Graphs share one memory pool; the inputs live outside it, one set per bucket. ``check``: each draft is also
    drafted step by step (``settle``), and ``check_report()`` says how often and where they differed."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        *,
        bucket: int = DRAFT_BUCKET,
        capture: bool | None = None,
        check: bool = False,
    ):
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
        self.check = check
        self._plain = drafter_proposer(drafter)
        self.checked, self.mismatched = 0, 0
        self.mismatches: list[dict] = []
        self._pending: list[tuple[int, int, Tensor, list[int]]] = []  # (n, bucket, draft, buckets built)
        self._last: tuple[Tensor, Tensor] | None = None  # the last context drafted from, with check

    def __call__(self, tokens: Tensor, features: Tensor) -> Tensor:
        n = features.shape[0]
        if tokens.shape[0] != n + 1:
            raise ValueError(
                f"tokens must be the n={n} verified tokens plus the block's first, got {tokens.shape[0]}"
            )
        length = math.ceil((n + 1) / self.bucket) * self.bucket
        step = self._steps.get(length) or self._build(length)
        if self.check and self._last is not None and n < self._last[1].shape[0]:
            self.settle()  # a shorter context: another sequence's, so the last one's drafts are all kept
        _load(step, tokens, features)
        draft = step.run().clone()
        if self.check:
            self._pending.append((n, length, draft, list(self._steps)))
            self._last = (tokens, features)
        return draft

    def settle(self) -> None:
        """With ``check``: compares the drafts kept since the last call with the forward's. Each context of
        one sequence is a prefix of its last one, so the comparison waits for the sequence's end and the
        graphs replay as they do unchecked. A caller moves to another sequence by calling this (a shorter
        context does it by itself)."""
        if not self._pending:
            return
        tokens, features = self._last
        for n, length, draft, built in self._pending:
            self._compare(draft, tokens[: n + 1], features[:n], length, built)
        self._pending.clear()

    def _compare(
        self, draft: Tensor, tokens: Tensor, features: Tensor, length: int, built: list[int]
    ) -> None:
        """Count a draft that differs from the step-by-step forward's; keep the first few with what tells the
        causes apart, each tried now on the same context: the same graph replayed again agreeing (the first
        replay met something passing: a race, or memory another graph wrote), the same buffers run eagerly
        differing (a buffer fault), a graph captured afresh agreeing (the old one went stale: moved weights,
        or memory another bucket's graph shares) or not (the captured kernels differ)."""
        with attending(self.drafter, "sdpa"):
            want = self._plain(tokens, features)
        self.checked += 1
        if torch.equal(draft, want):
            return
        self.mismatched += 1
        if len(self.mismatches) < KEPT_MISMATCHES:
            step = self._steps[length]
            _load(step, tokens, features)
            again, eager = step.run().clone(), step.eager()
            fresh = self._new_step(length, pool=None)  # its own buffers and memory pool, captured now
            _load(fresh, tokens, features)
            now = self._addresses()
            self.mismatches.append(
                {
                    "step": self.checked,
                    "context": features.shape[0],
                    "bucket": length,
                    "buckets_built": built,
                    "first_slot": int((draft != want).nonzero()[0, 0]) + 1,
                    "graphed": draft.tolist(),
                    "forward": want.tolist(),
                    "replayed_again_equal_forward": bool(torch.equal(again, want)),
                    "buffers_eager_equal_forward": bool(torch.equal(eager, want)),
                    "recaptured_equal_forward": bool(torch.equal(fresh.run(), want)),
                    "weights_moved": sorted(k for k, v in step.addresses.items() if now.get(k) != v),
                }
            )

    def check_report(self) -> dict:
        """With ``check``: drafts compared, how many differed, and the first ``KEPT_MISMATCHES`` of them."""
        self.settle()
        return {"checked": self.checked, "mismatched": self.mismatched, "first": self.mismatches}

    def _build(self, length: int) -> _Step:
        self._steps[length] = step = self._new_step(length, self._pool)
        return step

    def _addresses(self) -> dict[str, int]:
        """Where the weights a draft step reads live now (the target's embedding and head included)."""
        drafter = self.drafter
        named = dict(drafter.named_parameters())
        named |= {"embed_tokens": drafter.embed_tokens.weight, "lm_head": drafter.lm_head.weight}
        named["inv_freq"] = drafter.inv_freq
        return {name: t.data_ptr() for name, t in named.items()}

    def _new_step(self, length: int, pool) -> _Step:
        cfg, device = self.drafter.cfg, self.device
        dtype = self.drafter.fc.weight.dtype
        ids = torch.zeros(1, length, dtype=torch.long, device=device)
        features = torch.zeros(1, length, cfg.feature_size, dtype=dtype, device=device)
        anchor = torch.zeros(1, 1, dtype=torch.long, device=device)
        valid = torch.ones(1, 1, dtype=torch.bool, device=device)

        def forward() -> Tensor:
            with attending(self.drafter, "sdpa"):
                return draft_tokens(self.drafter, ids, features, anchor, valid)[0, 0]

        run = _captured(forward, pool) if self.capture else forward
        return _Step(ids, features, anchor, run, forward, self._addresses())


def _load(step: _Step, tokens: Tensor, features: Tensor) -> None:
    """A context into a bucket's buffers: rows from n on are never attended (zeros at first, an earlier
    context's finite features after)."""
    n = features.shape[0]
    step.ids[0, : n + 1].copy_(tokens)
    step.features[0, :n].copy_(features)
    step.anchor.fill_(n)


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
