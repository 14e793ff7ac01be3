"""Token-budget batch planning: which samples go together, deterministic per (seed, epoch)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

SORT_CHUNK = 256
"""Samples sorted by length within consecutive chunks of the shuffled order (less padding, still random)."""


def plan_batches(
    lengths: Sequence[int], token_budget: int, *, seed: int, epoch: int, exclude: Collection[int] = ()
) -> list[list[int]]:
    """The epoch's batches as lists of sample ids (indices into ``lengths``).

    Ids are shuffled by (seed, epoch) -- all ids, so excluding some keeps the others' relative order --,
    the ``exclude``d ids (e.g. already trained this epoch) are removed, lengths are sorted (descending)
    within chunks of ``SORT_CHUNK`` samples, then packed greedily in that order into batches of at most
    ``token_budget`` tokens (a sample longer than the budget gets a batch of its own), and the batch order
    is shuffled again. Every non-excluded id appears exactly once.
    """
    if token_budget < 1:
        raise ValueError(f"plan_batches: token_budget must be >= 1, got {token_budget}")
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)  # [N]
    n = lens.shape[0]
    if n and int(lens.min()) < 0:
        raise ValueError(f"plan_batches: lengths must be >= 0, got {int(lens.min())}")
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch) & 0xFFFFFFFF, 0x5EED])
    order = rng.permutation(n)  # [N]
    if len(exclude):
        ex = np.fromiter(exclude, dtype=np.int64, count=len(exclude))
        if int(ex.min()) < 0 or int(ex.max()) >= n:
            bad = int(ex.min()) if int(ex.min()) < 0 else int(ex.max())
            raise ValueError(
                f"plan_batches: exclude holds sample id {bad}, outside 0..{n - 1}; "
                "the exclusion list belongs to another dataset (check the data path and config)"
            )
        keep = np.ones(n, dtype=bool)
        keep[ex] = False
        order = order[keep[order]]
    if order.size == 0:
        return []
    # sort by length (descending) within chunks of the shuffled order; one stable argsort on a combined key
    chunk = np.arange(order.size, dtype=np.int64) // SORT_CHUNK
    key = (chunk << 32) + ((1 << 31) - 1 - np.minimum(lens[order], (1 << 31) - 1))
    order = order[np.argsort(key, kind="stable")]
    bounds = _greedy_bounds(lens[order], token_budget)
    ids = order.tolist()
    return [ids[bounds[i] : bounds[i + 1]] for i in rng.permutation(len(bounds) - 1).tolist()]


def _greedy_bounds(lens: np.ndarray, budget: int) -> list[int]:
    """Batch boundaries [0, ..., M] of greedy packing: a batch closes before the sample that would pass
    ``budget``. Jumps a batch at a time with searchsorted when batches hold many samples, else one plain
    pass (cheaper per element than a numpy call per batch)."""
    m = int(lens.shape[0])
    csum = np.concatenate(([0], np.cumsum(lens)))  # [M+1]
    bounds = [0]
    if int(csum[-1]) // budget * 16 < m:  # few batches: O(batches * log M)
        start = 0
        while start < m:
            end = int(np.searchsorted(csum, csum[start] + budget, side="right")) - 1
            start = min(max(end, start + 1), m)  # at least one sample per batch
            bounds.append(start)
        return bounds
    total = 0
    for i, n in enumerate(lens.tolist()):
        if total and total + n > budget:
            bounds.append(i)
            total = 0
        total += n
    bounds.append(m)
    return bounds
