"""The drafter's training step compiled against eager, over the shapes a run meets (issue 20's sweep).
(Past 400 lines on purpose: one experiment a device call runs whole, grid to recount, read top to bottom.)

For every drafter shape of the grid and every compile mode, builds the drafter as a worker does
(``train.build.build_drafter``: fp32 master weights, the frozen embedding and head in the compute dtype,
the step under bf16 autocast, ``loss_sum`` backward), warms it up as a worker does (``train.warmup``'s
synthetic batches), then feeds batches planned as a run plans them: sample lengths from a seeded
long-tailed distribution, ``data.batching.plan_batches`` under the token budget, right-padded [B, S]
rows, the loss mask on each sample's response part. Per batch it runs the same step compiled and eagerly
(on SDPA with the dense mask on CUDA: an independent attention kernel) from the same weights and records: the loss and every trainable gradient against eager (relative), the
step time (with any compile, and again without it where it compiled), MFU, and the graphs the batch compiled
(a recompile a real run pays after its first step). Modes: ``attention`` (``train.compile=attention``: the
flex mask and kernel), ``full`` (``train.compile=full``: also whole layers and fused CE terms).
MFU counts FLOPs as ``drafter_step.count_flops`` does: every linear layer, attention over the visible
(query, key) pairs, a sliding layer's over its window. ``--recount FILE`` prints a recorded sweep's MFU again
with today's count (the first H200 sweep counted sliding layers as full).

  PYTHONPATH=. python bench/compile_sweep.py --out DIR                        # the GPU grid (H200)
  PYTHONPATH=. python bench/compile_sweep.py --shapes qwen3-8b --draws 6 --out DIR
  PYTHONPATH=. python bench/compile_sweep.py --inductor split_reductions=False --out DIR   # a config probe
  PYTHONPATH=. python bench/compile_sweep.py --cpu --out DIR                  # tiny shapes (tests/bench)
  PYTHONPATH=. python bench/compile_sweep.py --recount DIR/compile_sweep.json  # MFU recounted, no run
Writes DIR/compile_sweep.json (provenance, config, rows, summary) after every shape, and the full
traceback of every failing batch to DIR/errors.log. A failing compile is a row with its error, not a
crash: the sweep exists to find such shapes.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from rich.console import Console
from torch import nn

from dflash_pipe.bench.result import BenchResult
from dflash_pipe.bench.save import save_result, show_result
from dflash_pipe.compute.compile import apply_dynamo_settings, backward_with_settings, compiler_errors
from dflash_pipe.compute.precision import autocast, compute_dtype
from dflash_pipe.config.presets import PRESETS
from dflash_pipe.config.train import TrainConfig
from dflash_pipe.data.batching import plan_batches
from dflash_pipe.drafter import DFlashDrafter, DrafterConfig
from dflash_pipe.drafter.checkpointing import CheckpointPolicy
from dflash_pipe.train.build import build_drafter
from dflash_pipe.train.optim import build_optimizer
from dflash_pipe.train.warmup import warm_up

PEAK_TFLOPS = 790.0  # H200 dense bf16, the MFU reference of this repo
sys.path.insert(0, str(Path(__file__).resolve().parent))
from drafter_step import count_flops  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """A drafter's widths (the target's) and the preset that sets its depth, layer types and block size."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    preset: str
    budget: int  # tokens per batch (train.token_budget)
    max_len: int  # longest sample (data.max_length)


GRID: dict[str, Shape] = {
    "qwen3-1.7b": Shape(2048, 16, 8, 128, 6144, 151936, "qwen3-8b", 8192, 4096),
    "qwen3-8b": Shape(4096, 32, 8, 128, 12288, 151936, "qwen3-8b", 8192, 4096),
    "llama3.1-8b": Shape(4096, 32, 8, 128, 14336, 128256, "llama3.1-8b", 8192, 4096),
    "head-dim-64": Shape(2048, 32, 8, 64, 6144, 151936, "qwen3-8b", 8192, 4096),
    "qwen3.6-27b": Shape(5120, 24, 4, 256, 17408, 248320, "qwen3.6-27b", 8192, 4096),
}
"""hidden 2048 / 4096 / 5120, head_dim 64 / 128 / 256, block 16 and 10, all-full and sliding+full layers."""
CPU_GRID: dict[str, Shape] = {
    "tiny-full": Shape(128, 4, 2, 32, 256, 512, "qwen3-8b", 512, 256),
    "tiny-block10": Shape(128, 4, 2, 32, 256, 512, "llama3.1-8b", 512, 256),
    "tiny-sliding": Shape(128, 4, 2, 64, 256, 512, "qwen3.6-27b", 512, 256),
}
"""The grid's cases in miniature: all-full block 16, block 10, sliding + full layers (window 64)."""
MODES = {"attention": "attention", "full": "full"}
"""The sweep's mode names and the ``train.compile`` value each builds (eager: ``off``)."""


def drafter_config(shape: Shape, *, max_anchors: int, sliding_window: int | None) -> DrafterConfig:
    preset = PRESETS[shape.preset]
    layer_types = preset.layer_types
    return DrafterConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.inter,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        sliding_window=(sliding_window or preset.sliding_window) if preset.sliding_window else None,
        vocab_size=shape.vocab,
        block_size=preset.block_size,
        mask_token_id=shape.vocab - 1,
        target_layer_ids=tuple(range(1, 6)),
        num_target_layers=8,
        max_anchors=max_anchors,
    )


def frozen_parts(cfg: DrafterConfig, device: torch.device) -> tuple[nn.Embedding, nn.Linear]:
    """The target's embedding and LM head stand-ins, in the compute dtype as a worker loads them."""
    torch.manual_seed(1)
    dtype = compute_dtype(device)
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
    head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=dtype)
    nn.init.normal_(head.weight, std=0.02)
    return embed, head


def build(
    cfg: DrafterConfig, compile_mode: str, parts, device: torch.device, checkpointing: str = "none"
) -> DFlashDrafter:
    """The drafter as a worker builds it; seeded, so every mode starts from the same weights."""
    torch.manual_seed(0)
    policy = CheckpointPolicy(checkpointing)  # type: ignore[arg-type]
    model, _ = build_drafter(cfg, TrainConfig(compile=compile_mode), *parts, device, checkpointing=policy)
    return model


def planned_batches(shape: Shape, count: int, seed: int) -> list[list[int]]:
    """Sample lengths as a chat dataset has them (log-normal, 64..max_len), planned into batches by
    ``plan_batches`` under the token budget: the (B, S) pairs and per-sample lengths a run meets."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(shape.max_len / 6), 0.9, size=40 * count), 64, shape.max_len)
    batches = plan_batches(lengths.astype(int).tolist(), shape.budget, seed=seed, epoch=0)
    return [[int(lengths[i]) for i in batch] for batch in batches[:count]]


def make_inputs(
    cfg: DrafterConfig, lengths: list[int], gen: torch.Generator, device
) -> tuple[torch.Tensor, ...]:
    """One batch as ``train.batches.unpack`` hands it over: right-padded [B, S], loss on each sample's
    response (from a random prompt share on), False on padding."""
    ids, mask = ids_and_mask(cfg, lengths, gen)
    b, s = ids.shape
    # the features drawn where they are used (on the host they cost more than the step itself at 8B)
    seeded = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    feats = torch.randn(b, s, cfg.feature_size, generator=seeded, device=device) * 0.5
    return ids.to(device), feats.to(compute_dtype(device)), mask.to(device)


def ids_and_mask(cfg: DrafterConfig, lengths: list[int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """The batch's token ids and loss mask, drawn on the host from ``gen`` (what ``recount`` redraws)."""
    b, s = len(lengths), max(lengths)
    ids = torch.randint(0, cfg.vocab_size - 1, (b, s), generator=gen)
    mask = torch.zeros(b, s, dtype=torch.bool)
    for row, length in enumerate(lengths):
        prompt = int(length * float(torch.empty(1).uniform_(0.1, 0.7, generator=gen)))
        mask[row, prompt:length] = True
    return ids, mask


def recount(path: Path, say) -> None:
    """MFU of a recorded sweep's rows again, with today's FLOP count (``drafter_step.count_flops``, which
    counts a sliding layer's attention over its window since the first H200 sweep): each row's batch is
    redrawn from the recorded seed and config on the host, the step time is the recorded one."""
    import json

    recorded = json.loads(path.read_text())
    config = recorded["config"]
    for row in recorded["rows"]:
        if "error" in row or not row.get("mfu"):
            continue
        grid = CPU_GRID if config.get("cpu") else GRID  # (the first sweeps' "shapes" holds the --shapes text)
        shape = dataclasses.replace(
            grid[row["shape"]],
            **{k: config[a] for k, a in (("budget", "budget"), ("max_len", "max_len")) if config.get(a)},
        )
        cfg = drafter_config(
            shape, max_anchors=config["max_anchors"], sliding_window=config["sliding_window"]
        )
        lengths = planned_batches(shape, config["draws"], config["seed"])[row["draw"]]
        gen = torch.Generator().manual_seed(config["seed"] * 1000 + row["draw"])
        ids, mask = ids_and_mask(cfg, lengths, gen)
        flops = count_flops(SimpleNamespace(cfg=cfg), (ids, None, mask))["train_step"]
        seconds = row.get("steady_seconds") or row["seconds"]
        say(
            f"{row['shape']} {row['mode']} draw {row['draw']}: MFU {row['mfu']:.1%} recorded, "
            f"{flops / seconds / (PEAK_TFLOPS * 1e12):.1%} recounted"
        )


def step(
    model: DFlashDrafter, inputs: tuple[torch.Tensor, ...], seed: int
) -> tuple[float, dict[str, torch.Tensor]]:
    """A worker's forward/backward (no optimizer: every model stays at the same weights)."""
    model.zero_grad(set_to_none=True)
    gen = torch.Generator(device=inputs[0].device).manual_seed(seed)
    with autocast(inputs[0].device):
        out = model(*inputs, generator=gen)
    backward_with_settings(out.loss_sum)
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(out.loss_sum.detach()), grads


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def graphs_compiled() -> int:
    """Dynamo's count of compiled graphs so far (a private counter; -1 where a torch lacks it)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return -1
    return int(counters["stats"]["unique_graphs"])


def timed(on: torch.device, fn, *args, **kwargs) -> tuple[Any, float]:
    """``fn(*args, **kwargs)`` and its wall time, the device synchronised on both sides."""
    if on.type == "cuda":
        torch.cuda.synchronize(on)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if on.type == "cuda":
        torch.cuda.synchronize(on)
    return out, time.perf_counter() - t0


def sweep_shape(
    name: str, shape: Shape, mode: str, args: argparse.Namespace, device, say, log_error, save
) -> list[dict[str, Any]]:
    """One shape in one mode: the warm-up, then every planned batch compiled (and against eager)."""
    shape = dataclasses.replace(
        shape, budget=args.budget or shape.budget, max_len=args.max_len or shape.max_len
    )
    cfg = drafter_config(shape, max_anchors=args.max_anchors, sliding_window=args.sliding_window)
    parts = frozen_parts(cfg, device)
    # the reference: eager, on SDPA with the dense mask (eager flex materialises every score: 100+ GiB),
    # recomputing in backward (eager activations of a batch of many short samples passed 100 GiB at 8B)
    eager = (
        build(dataclasses.replace(cfg, attention_backend="sdpa"), "off", parts, device, "all")
        if args.reference_every
        else None  # never checked: not built, its weights and gradients would crowd the compiled step
    )
    batches = planned_batches(shape, args.draws, args.seed)
    rows: list[dict[str, Any]] = []
    torch._dynamo.reset()
    model = build(cfg, MODES[mode], parts, device)
    model.kernels = dataclasses.replace(model.kernels, tuned_flex_tiles=args.flex_tiles == "drafter")
    if args.ce_chunk:
        model.ce_chunk = args.ce_chunk
    before = graphs_compiled()
    try:
        _, warm_s = timed(
            device,
            warm_up,
            model,
            drafter_config=asdict(cfg),
            cache_dir=Path(tempfile.mkdtemp(prefix="compile-sweep-warmup-")),  # its markers only
            device=device,
            seq_len=min(args.warmup_len, cfg.max_position_embeddings),
        )
        say(f"{name} {mode}: warm-up {warm_s:.1f} s, {graphs_compiled() - before} graph(s)")
        warm = {"warmup_s": round(warm_s, 2), "warmup_graphs": graphs_compiled() - before}
    except compiler_errors() + (RuntimeError,) as exc:
        log_error(f"{name} {mode} warm-up", exc)
        rows.append({"shape": name, "mode": mode, "draw": -1, "error": _first_line(exc)})
        say(f"{name} {mode} warm-up: {rows[-1]['error']}")
        return rows
    started = time.perf_counter()
    for i, lengths in enumerate(batches):
        if i < args.first_draw:
            continue
        if args.seconds and time.perf_counter() - started > args.seconds:
            say(f"{name} {mode}: --seconds {args.seconds:g} reached after draw {i - 1}")
            break
        gen = torch.Generator().manual_seed(args.seed * 1000 + i)
        inputs = make_inputs(cfg, lengths, gen, device)
        row: dict[str, Any] = {
            "shape": name,
            "mode": mode,
            "draw": i,
            "batch": len(lengths),
            "padded_len": max(lengths),
            "tokens": sum(lengths),
            "anchor_share": round(float(inputs[2].float().mean()), 3),
            "block_size": cfg.block_size,
            "layer_types": ",".join(sorted(set(cfg.layer_types))),
            **(warm if i == 0 else {}),
        }
        checked = bool(args.reference_every) and i % args.reference_every == 0
        try:
            ref_loss, ref_grads = step(eager, inputs, seed=i) if checked else (None, None)
            before = graphs_compiled()
            (loss, grads), seconds = timed(device, step, model, inputs, seed=i)
            new_graphs = graphs_compiled() - before if before >= 0 else None
            # again only where it compiled: the step without its compile
            steady = timed(device, step, model, inputs, seed=i)[1] if new_graphs else seconds
        except compiler_errors() + (RuntimeError,) as exc:
            log_error(f"{name} {mode} draw {i} {lengths}", exc)
            row.update(error=_first_line(exc))
            rows.append(row)
            say(f"{name} {mode} draw {i}: {row['error']}")
            continue
        flops = count_flops(model, inputs)["train_step"]
        if checked:
            row.update(
                loss_rel=relative(torch.tensor(loss), torch.tensor(ref_loss)),
                grad_rel_max=max(relative(grads[n], ref_grads[n]) for n in ref_grads),
            )
            row["within_tolerance"] = (
                row["loss_rel"] <= args.loss_tol and row["grad_rel_max"] <= args.grad_tol
            )
        row.update(
            seconds=round(seconds, 4),
            steady_seconds=round(steady, 4),
            new_graphs=new_graphs,
            mfu=round(flops / steady / (PEAK_TFLOPS * 1e12), 4) if device.type == "cuda" else None,
        )
        rows.append(row)
        if i % 10 == 9:  # a long run's rows survive its time limit
            save(rows)
        mfu = f", MFU {row['mfu']:.1%}" if row["mfu"] else ""
        ref = f", loss rel {row['loss_rel']:.2e}, grad rel {row['grad_rel_max']:.2e}" if checked else ""
        if checked or new_graphs or i % 50 == 0:
            say(
                f"{name} {mode} draw {i}: B {len(lengths)} x {max(lengths)}{ref}, {seconds:.3f} s then "
                f"{steady:.3f} s{mfu}, {new_graphs} new graph(s)"
            )
    done = [r for r in rows if "error" not in r and r["draw"] >= 0]
    if args.profile and done:
        draw = done[-1]["draw"]  # compiled already: the profile shows the steady step
        gen = torch.Generator().manual_seed(args.seed * 1000 + draw)
        kernels = profile_step(model, make_inputs(cfg, batches[draw], gen, device), draw, device)
        (args.out / f"profile_{name}_{mode}.txt").write_text(f"draw {draw} {batches[draw]}\n{kernels}\n")
        say(f"{name} {mode}: kernel table of draw {draw} in profile_{name}_{mode}.txt")
    if done:  # last: the update changes the weights every comparison above relied on
        update_s = update_seconds(model, device)
        for row in done:
            steady = row["steady_seconds"]
            row["update_seconds"] = round(update_s, 4)
            row["mfu_with_update"] = row["mfu"] and round(row["mfu"] * steady / (steady + update_s), 4)
        say(f"{name} {mode}: the weight update (clip + AdamW) {update_s * 1e3:.1f} ms a step")
    return rows


def update_seconds(model: DFlashDrafter, device: torch.device) -> float:
    """A worker's update after the step's backward (gradient clip, then AdamW), median of 3 after one.
    Every trainable weight gets a gradient in a step; where a failed last batch's ``zero_grad`` left none,
    zeros stand in (the update's time does not depend on the values)."""
    cfg = TrainConfig()
    params = list(model.trainable_parameters())
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    optimizer = build_optimizer(params, cfg)

    def update() -> None:
        float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))  # the worker reads the norm
        optimizer.step()

    update()
    times = [timed(device, update)[1] for _ in range(3)]
    return statistics.median(times)


def profile_step(model: DFlashDrafter, inputs: tuple[torch.Tensor, ...], seed: int, device) -> str:
    """The kernels of two steady steps of one batch, by GPU time (where a shape's step time goes)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step(model, inputs, seed)
    with profile(activities=activities) as prof:
        for _ in range(2):
            step(model, inputs, seed)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=45, max_name_column_width=90)


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per shape and mode: batches that compiled after warm-up, the steady step, MFU, and the share of the
    batches' time spent in those compiles (the issue's goal: under 2% of a run's first 500 steps)."""
    out: dict[str, Any] = {"rows_failed": sum("error" in r for r in rows)}
    out["rows_outside_tolerance"] = sum(r.get("within_tolerance") is False for r in rows)
    out["rows_checked"] = sum("within_tolerance" in r for r in rows)
    for key in sorted({(r["shape"], r["mode"]) for r in rows}):
        mine = [r for r in rows if (r["shape"], r["mode"]) == key and "error" not in r]
        tag = f"{key[0]}_{key[1]}"
        out[f"{tag}_recompiling_draws"] = sum(bool(r["new_graphs"]) for r in mine)
        out[f"{tag}_steady_step_s"] = (
            round(statistics.median(r["steady_seconds"] for r in mine), 4) if mine else None
        )
        for field in ("mfu", "mfu_with_update"):
            mfus = [r[field] for r in mine if r.get(field)]
            out[f"{tag}_{field}_median"] = round(statistics.median(mfus), 4) if mfus else None
        extra = sum(r["seconds"] - r["steady_seconds"] for r in mine if r["new_graphs"])
        total = sum(r["seconds"] for r in mine)
        out[f"{tag}_recompile_share"] = round(extra / total, 4) if total else None
    return out


def parse_inductor(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs for ``torch._inductor.config`` (values as Python literals)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--inductor {pair!r}: expected KEY=VALUE, e.g. split_reductions=False")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> BenchResult:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="where compile_sweep.json goes (required unless --recount)")
    p.add_argument("--recount", type=Path, help="print a recorded compile_sweep.json's MFU recounted; no run")
    p.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (fp32), what tests/bench runs")
    p.add_argument("--shapes", default=None, help=f"comma list of {', '.join(GRID)} (default: all)")
    p.add_argument("--modes", default="attention,full", help="comma list of attention, full")
    p.add_argument("--draws", type=int, default=6, help="planned batches per shape and mode, after warm-up")
    p.add_argument(
        "--reference-every", type=int, default=1, help="check against eager every Nth batch (0: never)"
    )
    p.add_argument(
        "--first-draw", type=int, default=0, help="start at this batch of the plan (a long run in parts)"
    )
    p.add_argument(
        "--seconds", type=float, default=0, help="stop drawing after this long (then profile, update, save)"
    )
    p.add_argument(
        "--ce-chunk", type=int, default=None, help="LM-head rows per CE chunk (default: the model's)"
    )
    p.add_argument(
        "--flex-tiles",
        choices=("drafter", "inductor"),
        default="drafter",
        help="the drafter's flex tiles (compute.compile.flex_kernel_options) or Inductor's own (an A/B)",
    )
    p.add_argument(
        "--profile", action="store_true", help="a kernel table of each shape and mode's last batch"
    )
    p.add_argument("--budget", type=int, default=None, help="tokens per batch (default: the shape's)")
    p.add_argument("--max-len", type=int, default=None, help="longest sample (default: the shape's)")
    p.add_argument("--max-anchors", type=int, default=512)
    p.add_argument(
        "--warmup-len", type=int, default=1024, help="the warm-up's longer length (default: a worker's, 1024)"
    )
    p.add_argument("--sliding-window", type=int, default=None, help="override the presets' window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inductor", action="append", default=[], help="KEY=VALUE for torch._inductor.config")
    p.add_argument("--loss-tol", type=float, default=None, help="default: 1e-2 in bf16, 1e-4 in fp32")
    p.add_argument("--grad-tol", type=float, default=None, help="default: 5e-2 in bf16, 1e-3 in fp32")
    args = p.parse_args(argv)
    if args.recount:
        recount(args.recount, print)
        raise SystemExit(0)
    if args.out is None:
        p.error("--out DIR is required (or --recount FILE)")
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    grid = CPU_GRID if args.cpu else GRID
    names = list(grid) if not args.shapes else [s.strip() for s in args.shapes.split(",")]
    if unknown := [n for n in names if n not in grid]:
        p.error(f"--shapes: unknown {unknown}; choose from {', '.join(grid)}")
    args.modes = [m.strip() for m in args.modes.split(",")]
    if bad := [m for m in args.modes if m not in MODES]:
        p.error(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    if args.cpu:
        args.max_anchors = min(args.max_anchors, 32)
        args.sliding_window = args.sliding_window or 64
    bf16 = compute_dtype(device) == torch.bfloat16
    args.loss_tol = args.loss_tol if args.loss_tol is not None else (1e-2 if bf16 else 1e-4)
    args.grad_tol = args.grad_tol if args.grad_tol is not None else (5e-2 if bf16 else 1e-3)
    inductor = parse_inductor(args.inductor)
    import torch._inductor.config as inductor_config

    for key, value in inductor.items():  # dotted keys reach sections: triton.mix_order_reduction=False
        *sections, leaf = key.split(".")
        owner: Any = inductor_config
        for section in sections:
            owner = getattr(owner, section, None)
        if owner is None or not hasattr(owner, leaf):
            p.error(f"--inductor {key}: torch {torch.__version__}'s Inductor has no such option")
        setattr(owner, leaf, value)
    apply_dynamo_settings()
    args.out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    errors = args.out / "errors.log"
    errors.write_text("")

    def log_error(where: str, exc: BaseException) -> None:
        with errors.open("a") as fh:
            fh.write(f"=== {where}\n{''.join(traceback.format_exception(exc))}\n")

    config = {
        "device": str(device),
        "dtype": str(compute_dtype(device)),
        "grid": {n: asdict(grid[n]) for n in names},
        "inductor": inductor,
        **{k: v for k, v in vars(args).items() if k not in ("out", "inductor")},
    }
    rows: list[dict[str, Any]] = []

    def say(line: str) -> None:
        console.print(line, markup=False)

    def save(upto: list[dict[str, Any]]) -> BenchResult:
        result = BenchResult(name="compile_sweep", config=config, rows=upto, summary=summarize(upto))
        save_result(result, args.out)
        return result

    for name in names:
        for mode in args.modes:  # saved after each: a time limit keeps what ran
            done = list(rows)
            rows += sweep_shape(
                name,
                grid[name],
                mode,
                args,
                device,
                say,
                log_error,
                lambda mine, done=done: save(done + mine),
            )
            result = save(rows)
    show_result(result, console)
    return result


if __name__ == "__main__":
    main()
