"""The worker's compile warm-up, before real batches arrive: every worker at once, or one under a lock.

Inductor's cache is safe to share but does not deduplicate work: workers that start together on an empty
cache each compile everything. ``train.compile_warmup="each"`` (the default) lets them: more CPU, but nobody
waits. ``"once"`` takes a file lock plus a marker file, turning N cold compiles into one cold and N-1 warm
ones: the least CPU, but the others wait for the whole compile and then still trace.
`dflash-pipe bench compile --compile-warmup once,each` measures both (docs/performance.md has the figures).

In threaded mode the worker warms each replica in turn before its threads start: every variant compiled
here is one the threads never have to compile (docs/architecture.md, "Threaded mode"). In either mode the
warm-up runs single-sample batches too, so a run's first batch of one sample compiles nothing.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from dflash_pipe.compute.compile import backward_with_settings
from dflash_pipe.compute.precision import autocast, compute_dtype


def warm_up(
    model: torch.nn.Module,
    *,
    drafter_config: dict[str, Any],
    cache_dir: Path,
    device: torch.device,
    seq_len: int,
    batch_sizes: tuple[int, ...] = (2, 1),
    once: bool = False,
) -> dict[str, float]:
    """Runs synthetic steps so every compiled variant exists before real batches arrive: batches of 2 and
    of 1 (dynamic shapes specialise on size 1, and a batch of one long sample that the next one does not
    fit beside is common), each at two lengths and two anchor counts (``warmup_batches``). ``once``: under
    the cache's lock, so workers that start together compile once (``train.compile_warmup``)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(
        json.dumps(
            [drafter_config, torch.__version__, str(device.type), batch_sizes], sort_keys=True
        ).encode()
    ).hexdigest()[:16]
    marker = cache_dir / f"warm-{key}"
    t0 = time.time()
    waited = 0.0
    if marker.exists() or not once:
        cold = not marker.exists()
        _synthetic_steps(model, drafter_config, device, seq_len, batch_sizes)
        if cold:
            marker.write_text(f"{time.time()}\n")
        return {"warmup_s": time.time() - t0, "warmup_waited_s": 0.0, "warmup_cold": float(cold)}
    with FileLock(str(cache_dir / "warmup.lock")):
        waited = time.time() - t0
        cold = not marker.exists()
        _synthetic_steps(model, drafter_config, device, seq_len, batch_sizes)
        marker.write_text(f"{time.time()}\n")
    return {"warmup_s": time.time() - t0, "warmup_waited_s": waited, "warmup_cold": float(cold)}


def _synthetic_steps(
    model: torch.nn.Module,
    cfg: dict[str, Any],
    device: torch.device,
    seq_len: int,
    batch_sizes: tuple[int, ...],
) -> None:
    for batch in warmup_batches(cfg, device, seq_len, batch_sizes):
        with autocast(device):
            out = model(*batch, generator=torch.Generator(device=device).manual_seed(0))
        backward_with_settings(out.loss_sum)
    for p in model.parameters():
        p.grad = None


def warmup_batches(
    cfg: dict[str, Any], device: torch.device, seq_len: int, batch_sizes: tuple[int, ...]
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per batch size: both warm-up lengths with every position trainable (``max_anchors`` anchors), then
    the shorter one with fewer anchors. A dynamic graph's first compile equates dimensions of equal size
    (duck sizing): 512 anchors beside a 512-wide K/V projection (8 x 64) became one size, and the first real
    batch with fewer anchors compiled again mid-run (an H200 run at head_dim 64). A second anchor count,
    5/8 of the cap (320 for 512: no power of two, unlike the projections' widths), pays that compile here."""
    short = warmup_lengths(seq_len)[-1]
    for b in batch_sizes:  # one batch at a time on the device (the features are the big part)
        for length in warmup_lengths(seq_len):
            yield synthetic_batch(cfg, device, b, length)
        untrained = short - fewer_anchors(cfg["max_anchors"]) - 1
        if untrained > 0:  # else the short batch above had no more anchors than this one: nothing new
            ids, feats, loss_mask = synthetic_batch(cfg, device, b, short)
            loss_mask[:, :untrained] = False
            yield ids, feats, loss_mask


def fewer_anchors(max_anchors: int) -> int:
    """The warm-up's second anchor count (``training_eligible`` counts n positions in n + 1 trained ones)."""
    return max(1, max_anchors * 5 // 8)


def warmup_lengths(seq_len: int) -> tuple[int, int]:
    """The warm-up's two lengths per batch size: the first compile of a dynamic graph may specialise on its
    one length, and Inductor's size thresholds (fusion, reductions) make variants on either side."""
    return seq_len, max(seq_len // 2, 8)


def synthetic_batch(
    cfg: dict[str, Any], device: torch.device, batch: int, length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random token ids, features in the compute dtype and an all-True loss mask: [B, S] as ``unpack``
    hands a real batch over (``cfg`` is ``DrafterConfig.to_dict()``, what WELCOME carries)."""
    k = len(cfg["target_layer_ids"])
    ids = torch.randint(0, cfg["vocab_size"], (batch, length), device=device)
    feats = torch.randn(batch, length, k * cfg["hidden_size"], device=device, dtype=compute_dtype(device))
    return ids, feats, torch.ones(batch, length, dtype=torch.bool, device=device)
