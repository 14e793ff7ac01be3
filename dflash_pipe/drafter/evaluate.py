"""Acceptance-length evaluation of a drafter against a target (TargetCore interface) and its table."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch import Tensor

from dflash_pipe.compute.precision import autocast, compute_dtype

from .acceptance import AcceptanceCounts, acceptance
from .model import DFlashDrafter


class TargetLike(Protocol):
    """The part of dflash_pipe.target.TargetCore evaluation needs."""

    def features(self, input_ids: Tensor, lengths: Sequence[int]) -> Tensor: ...  # [T] -> [T, k*H]

    def greedy_next(self, input_ids: Tensor, lengths: Sequence[int]) -> Tensor: ...  # [T] -> [T]


@dataclass
class AcceptanceResult:
    counts: AcceptanceCounts
    num_samples: int
    num_tokens: int
    seconds: float

    @property
    def tau(self) -> float:
        return self.counts.tau

    def metrics(self) -> dict[str, Any]:
        return simulated_metrics(self.counts)


def simulated_metrics(counts: AcceptanceCounts) -> dict[str, Any]:
    """The ``simulated/...`` keys of metrics.jsonl (and of `eval --mode simulated --out`)."""
    rates = counts.per_slot_rate[1:]
    return {"simulated/tau": float(counts.tau), "simulated/acceptance_per_slot": [float(x) for x in rates]}


def _batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Consecutive samples packed up to token_budget tokens (a longer sample goes alone)."""
    out: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if cur and used + n > token_budget:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        out.append(cur)
    return out


def _unpack(flat: Tensor, lengths: Sequence[int], fill: Any) -> Tensor:
    """Packed [T, ...] -> padded [B, S, ...]."""
    seq = max(lengths)
    out = flat.new_full((len(lengths), seq, *flat.shape[1:]), fill)
    start = 0
    for row, n in enumerate(lengths):
        out[row, :n] = flat[start : start + n]
        start += n
    return out


@torch.no_grad()
def evaluate_acceptance(
    target: TargetLike,
    drafter: DFlashDrafter,
    samples: Sequence[Any],
    *,
    num_anchors: int = 64,
    token_budget: int = 16384,
    progress: bool = True,
    seed: int = 0,
) -> AcceptanceResult:
    """Simulated tau over `samples` (objects with input_ids [S] and loss_mask [S]); seeded anchors."""
    device = drafter.fc.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    lengths = [int(s.input_ids.numel()) for s in samples]
    counts = AcceptanceCounts.zeros(drafter.cfg.block_size)
    t0 = time.perf_counter()
    was_training = drafter.training
    drafter.eval()
    with Progress(
        TextColumn("acceptance"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), disable=not progress
    ) as bar:
        task = bar.add_task("eval", total=len(samples))
        for group in _batches(lengths, token_budget):
            lens = [lengths[i] for i in group]
            ids = torch.cat([samples[i].input_ids for i in group]).to(device)  # [T]
            feats = target.features(ids, lens).to(device)  # [T, k*H]
            nxt = target.greedy_next(ids, lens).to(device)  # [T]
            mask = torch.cat([samples[i].loss_mask for i in group]).to(device)  # [T]
            counts = counts + acceptance(
                drafter,
                _unpack(ids, lens, 0),
                _unpack(feats, lens, 0),
                _unpack(mask, lens, False),
                _unpack(nxt, lens, -1),
                num_anchors=num_anchors,
                generator=gen,
            )
            bar.advance(task, len(group))
    drafter.train(was_training)
    return AcceptanceResult(
        counts=counts, num_samples=len(samples), num_tokens=sum(lengths), seconds=time.perf_counter() - t0
    )


def simulate_export(
    target_model: str | Path,
    drafter_dir: str | Path,
    samples: Sequence[Any],
    *,
    device: torch.device,
    num_anchors: int = 64,
    progress: bool = False,
    warn: Callable[[str], None] | None = None,
) -> AcceptanceResult:
    """`dflash-pipe eval --mode simulated`: the target's features and greedy predictions on ``samples``'
    own text (TargetCore, bf16 on CUDA) and an exported drafter on the target's embedding and LM head. The
    export is checked against its manifest before the target loads (``warn`` hears that one without a
    manifest is unverified)."""
    from dflash_pipe.target import TargetCore

    from .export import load_exported, read_export_config, verify_export
    from .target_parts import load_frozen_target_parts

    verify_export(drafter_dir, warn=warn)
    dtype = compute_dtype(device)
    cfg = read_export_config(drafter_dir)
    target = TargetCore(target_model, cfg.target_layer_ids, device, dtype)
    embed, head = load_frozen_target_parts(target_model, dtype=dtype, device=device)
    drafter = load_exported(drafter_dir, embed_tokens=embed, lm_head=head, verify=False).to(device)
    with autocast(device):
        return evaluate_acceptance(target, drafter, samples, num_anchors=num_anchors, progress=progress)


def render_acceptance_table(result: AcceptanceResult) -> Table:
    """tau plus per-slot acceptance rates, for the terminal."""
    c = result.counts
    title = f"simulated acceptance: tau = {c.tau:.3f} over {c.anchors} blocks ({result.num_samples} samples)"
    return per_slot_table(c, title, columns=("slot k", "accepted", "rate (>= k accepted)"))


def per_slot_table(counts: AcceptanceCounts, title: str, *, columns: tuple[str, str, str]) -> Table:
    """One row per draft slot k = 1..bs-1: how many blocks kept it, and that as a share of all blocks."""
    table = Table(title=title)
    for name in columns:
        table.add_column(name, justify="right")
    rates = counts.per_slot_rate
    for k in range(1, counts.per_slot_accepted.numel()):
        table.add_row(str(k), str(int(counts.per_slot_accepted[k])), f"{float(rates[k]):.3f}")
    return table
