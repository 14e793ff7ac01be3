"""What the peer trainers (SpecForge's and speculators' DFlash, ``bench/peers/``) share: the rows dflash-pipe
trains on, the target's features by an HF forward, the wall-clock budget around a peer's training loop
(``TimeBudget``, driving any trainer through ``PeerControl``), and the scripts' common flags.

Each peer's own module (``peers.py`` for SpecForge, ``speculators_peer.py``) imports its package lazily and
adapts it to ``PeerControl``; nothing of either package is imported here.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch


@dataclass(kw_only=True, slots=True)
class Row:
    """One tokenized training row, exactly as dflash-pipe trains it."""

    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool


def write_rows(conversations: Path, tokenizer: Any, out: Path, *, max_length: int, limit: int | None) -> int:
    """Tokenize a conversations JSONL the way dflash-pipe does and write the rows as pre-tokenized JSONL
    (``{"input_ids", "loss_mask"}`` per line); returns the rows written. A regenerated file gives the
    samples its run trained (``data.regen_samples``: the target's own ids where a line keeps them), any
    other file what ``load_samples`` makes of it."""
    from dflash_pipe.data.config import DataConfig
    from dflash_pipe.data.loader import load_samples
    from dflash_pipe.data.regen_samples import is_regenerated_file, regenerated_samples

    cfg = DataConfig(path=conversations, max_length=max_length)
    if is_regenerated_file(conversations):
        made = regenerated_samples(conversations, tokenizer, cfg)
    else:
        made = iter(load_samples(cfg, tokenizer).samples)
    samples = list(itertools.islice(made, limit))
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for s in samples:
            line = {"input_ids": s.input_ids.tolist(), "loss_mask": [int(m) for m in s.loss_mask.tolist()]}
            f.write(json.dumps(line) + "\n")
    return len(samples)


def read_rows(path: Path, tokenizer: Any, *, max_length: int) -> list[Row]:
    """The rows of a pre-tokenized JSONL through dflash-pipe's own loader (same truncation and drops)."""
    from dflash_pipe.data.config import DataConfig
    from dflash_pipe.data.loader import load_samples

    loaded = load_samples(DataConfig(path=path, max_length=max_length), tokenizer)
    return [Row(input_ids=s.input_ids, loss_mask=s.loss_mask.bool()) for s in loaded.samples]


def layer_features(out: Any, layer_ids: Sequence[int]) -> torch.Tensor:
    """The context features of an HF forward with ``output_hidden_states``: ``hidden_states[id + 1]`` of
    each layer id concatenated on the last axis, [B, T, k*H] in the target's dtype (what dflash-pipe's
    producer sends and both peers' offline records hold)."""
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


class PeerControl(Protocol):
    """What ``TimeBudget`` asks of a peer's trainer."""

    def save(self, step: int) -> str | None:
        """Save a checkpoint of this step; its URI or path, None when this step is saved already."""

    def stop(self, step: int) -> None:
        """End the run after this step."""

    def set_horizon(self, horizon: int, warmup: int) -> None:
        """Re-aim the LR schedule (still warming up): warm-up to ``warmup``, decay to zero at ``horizon``."""


@dataclass(kw_only=True, slots=True)
class TimeBudget:
    """A peer trainer's step hook: every optimizer step's metrics go to a JSONL file; a checkpoint is saved
    at each mark (seconds since ``start``); the run stops at ``deadline``. Without a step plan the
    schedule's horizon is fitted to the budget once, early in the warm-up: steps done + the step rate
    measured after the first two steps (compilation, warm-up) x the time left (warm-up ``warmup_ratio`` of
    that, decay over the rest); the run then also stops at that horizon, where the schedule reaches zero."""

    start: float
    """time.perf_counter() when the budget began (before the capture)."""
    deadline: float
    """Seconds after ``start`` at which training stops (after the step in flight)."""
    marks: list[float]
    """Seconds after ``start`` at which to save a checkpoint."""
    metrics_path: Path
    warmup_ratio: float
    fit_horizon: bool
    """True: no step plan was given; fit the scheduler's horizon to the budget."""
    print_every: int = 10
    console: Callable[[dict, int], None] | None = None
    """The peer's own console logger, called every ``print_every`` steps."""
    trainer: PeerControl | None = None
    """The peer's trainer (set after it is built)."""
    probe_start: float | None = None
    """When step 2 ended: the step rate is measured from here."""
    horizon: int | None = None
    saved: list[dict[str, Any]] = field(default_factory=list)
    last: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    stopped_by: str = "steps"

    def __call__(self, metrics: dict[str, Any], step: int) -> None:
        now = time.perf_counter()
        if step == 2:
            self.probe_start = now
        row = {"step": step, "elapsed_s": round(now - self.start, 3)} | scalars(metrics)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.last, self.steps = row, step
        if self.console is not None and (step % self.print_every == 0 or step == 1):
            self.console(metrics, step)
        if self.fit_horizon and self.horizon is None:
            self._maybe_fit_horizon(step, now)
        while self.marks and now - self.start >= self.marks[0]:
            self.marks.pop(0)
            self.save(step, now)
        if now - self.start >= self.deadline:
            self.stop(step, "time")
        elif self.horizon is not None and step >= self.horizon:
            self.stop(step, "horizon")

    def stop(self, step: int, why: str) -> None:
        """End the run after this step (the peer then saves it as its last checkpoint)."""
        self.stopped_by = why
        self._trainer().stop(step)

    def save(self, step: int, now: float) -> None:
        uri = self._trainer().save(step)
        if uri is not None:
            self.saved.append({"step": step, "elapsed_s": round(now - self.start, 3), "uri": uri})

    def _trainer(self) -> PeerControl:
        if self.trainer is None:
            raise RuntimeError("TimeBudget.trainer is not set: set it once the peer's trainer is built")
        return self.trainer

    def _maybe_fit_horizon(self, step: int, now: float) -> None:
        """Fit once 10 steps and 5 s (or 2% of the budget) have passed since step 2, or, on a slow device,
        3 steps and a tenth of the time left."""
        if self.probe_start is None or step < 3:
            return
        probed, ran = step - 2, now - self.probe_start
        left = self.deadline - (now - self.start)
        if not ((probed >= 10 and ran >= min(5.0, 0.02 * self.deadline)) or ran >= 0.1 * left):
            return
        rate = probed / ran
        horizon = int(step + rate * max(self.deadline - (now - self.start), 0.0))
        # The warm-up must still run a step after this one: its last step sets the peak LR the decay
        # starts from.
        warmup = max(int(self.warmup_ratio * horizon), step + 2)
        horizon = max(horizon, warmup + 1)
        self._trainer().set_horizon(horizon, warmup)
        self.horizon = horizon


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics that are numbers (tensors included), as floats."""
    out = {}
    for key, value in metrics.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out


def budget_marks(minutes: float, save_at: Sequence[float] | None) -> list[float]:
    """Checkpoint marks in seconds: ``save_at`` minutes, default a quarter and a half of the budget (the
    end is saved anyway)."""
    marks = save_at if save_at else [minutes / 4, minutes / 2]
    return sorted(60.0 * m for m in marks if 0 < m < minutes)


def mean_row_tokens(rows: Sequence[Row]) -> float:
    return float(sum(int(r.input_ids.numel()) for r in rows)) / max(1, len(rows))


def peer_arg_parser(description: str) -> argparse.ArgumentParser:
    """The flags every peer script takes (rows, budget, device, drafter shape); each adds its own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--target", type=Path, required=True, help="HF folder of the target model")
    p.add_argument(
        "--rows", type=Path, required=True, help="pre-tokenized JSONL: {input_ids, loss_mask} per line"
    )
    p.add_argument("--conversations", type=Path, help="write --rows first from this conversations JSONL")
    p.add_argument("--max-rows", type=int, help="with --conversations: keep the first N rows")
    p.add_argument(
        "--rows-only", action="store_true",
        help="write --rows from --conversations and stop: rows prepared ahead stay out of the timed run",
    )  # fmt: skip
    p.add_argument("--max-length", type=int, default=3072, help="tokens per row (truncation)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, required=True, help="wall-clock budget from the start of capture")
    p.add_argument("--save-at", type=float, nargs="*", help="checkpoint marks in minutes (default M/4, M/2)")
    p.add_argument(
        "--capture-share", type=float, default=0.5, help="stop capturing at this share of the budget"
    )
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"]
    )
    p.add_argument("--layers", type=int, default=5, help="drafter layers")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mask-token-id", type=int, required=True)
    p.add_argument("--max-anchors", type=int, default=512)
    p.add_argument(
        "--steps", type=int, help="planned optimizer steps (the schedule's horizon); default: fit to budget"
    )
    p.add_argument("--slot-rows", type=int, default=16, help="rows for the per-slot accuracy at the end")
    p.add_argument("--seed", type=int, default=0)
    return p


def check_peer_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.rows_only and args.conversations is None:
        p.error("--rows-only writes --rows from --conversations: give --conversations")
    return args


def prepare_rows(args: argparse.Namespace) -> Any:
    """The target's tokenizer, after writing ``--rows`` from ``--conversations`` when given (timed, said)."""
    from transformers import AutoTokenizer

    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    if args.conversations is not None:
        t0 = time.perf_counter()
        n = write_rows(
            args.conversations, tokenizer, args.rows, max_length=args.max_length, limit=args.max_rows
        )
        print(f"wrote {n} rows to {args.rows} in {time.perf_counter() - t0:.1f}s", flush=True)
    return tokenizer


def metrics_tail(path: Path, n: int = 20) -> dict[str, float]:
    """Mean loss and accuracy over the last ``n`` logged steps (0 where a key is missing)."""
    tail = [json.loads(line) for line in path.read_text().splitlines()[-n:]] if path.exists() else []
    keys = {"mean_acc_last_20_steps": "acc", "mean_loss_last_20_steps": "loss"}
    return {k: round(sum(m.get(v, 0.0) for m in tail) / max(1, len(tail)), 4) for k, v in keys.items()}


def package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@dataclass(kw_only=True, slots=True)
class Capture:
    """When a peer's budget began and what its capture did."""

    start: float
    """time.perf_counter() at the start of the budget (before the target loads)."""
    deadline: float
    """The budget in seconds."""
    layer_ids: list[int]
    captured: int
    capture_s: float
    target_config: Any


def capture_timed(
    args: argparse.Namespace,
    rows: Sequence[Row],
    layer_ids_of: Callable[[Any], list[int]],
    capture: Callable[[Any, list[int], Callable[[], bool]], int],
) -> Capture:
    """Start the budget, load the target (bf16 on CUDA, fp32 on CPU), capture with ``capture(target,
    layer_ids, should_stop)`` until ``--capture-share`` of the budget, then free the target: the part of a
    peer's minutes both peers spend alike."""
    import gc

    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start = time.perf_counter()
    deadline = 60.0 * args.minutes
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
    layer_ids = layer_ids_of(target.config)
    captured = capture(
        target, layer_ids, lambda: time.perf_counter() - start >= args.capture_share * deadline
    )
    capture_s = time.perf_counter() - start
    config = target.config
    del target
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"captured {captured}/{len(rows)} rows in {capture_s:.1f}s (layers {layer_ids})", flush=True)
    return Capture(
        start=start,
        deadline=deadline,
        layer_ids=layer_ids,
        captured=captured,
        capture_s=capture_s,
        target_config=config,
    )
