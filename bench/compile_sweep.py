"""The drafter's training step compiled against eager, over the shapes a run meets (issue 20's sweep).

For every drafter shape of the grid and every compile mode, draws context lengths and anchor counts the way
a run does (packed rows up to the token budget, a random share of positions eligible as anchors), runs the
same step eagerly and compiled from the same weights, and records per draw: the loss and every trainable
gradient against eager (relative), the step time, and the graphs compiled so far (a draw that compiles
anew is a recompile a real run pays). Modes: ``attention`` (today's default on CUDA: the flex mask and
kernel), ``full`` (whole layers, fused CE terms: ``train.compile=full``).
MFU counts every layer's attention over the full-attention pattern (``drafter_step.count_flops``), so on
sliding-window layers it is an upper bound; attention is a small share of the step's FLOPs.

  PYTHONPATH=. python bench/compile_sweep.py --out DIR                        # the GPU grid (H200)
  PYTHONPATH=. python bench/compile_sweep.py --shapes qwen3-8b --draws 6 --out DIR
  PYTHONPATH=. python bench/compile_sweep.py --cpu --out DIR                  # tiny shapes (tests/bench)
Writes DIR/compile_sweep.json (provenance, config, rows, summary). A failing compile is a row with its
error, not a crash: the sweep exists to find such shapes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn

from dflash_pipe.bench.result import BenchResult
from dflash_pipe.bench.save import save_result, show_result
from dflash_pipe.compute.compile import apply_dynamo_settings, compiler_errors
from dflash_pipe.drafter import DFlashDrafter, DrafterConfig
from dflash_pipe.drafter.presets import PRESETS

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
    budget: int  # tokens per packed row


GRID: dict[str, Shape] = {
    "qwen3-1.7b": Shape(2048, 16, 8, 128, 6144, 151936, "qwen3-8b", 8192),
    "qwen3-8b": Shape(4096, 32, 8, 128, 12288, 151936, "qwen3-8b", 8192),
    "llama3.1-8b": Shape(4096, 32, 8, 128, 14336, 128256, "llama3.1-8b", 8192),
    "head-dim-64": Shape(2048, 32, 8, 64, 6144, 151936, "qwen3-8b", 8192),
    "qwen3.6-27b": Shape(5120, 24, 4, 256, 17408, 248320, "qwen3.6-27b", 8192),
}
"""hidden 2048 / 4096 / 5120, head_dim 64 / 128 / 256, block 16 and 10, all-full and sliding+full layers."""
CPU_GRID: dict[str, Shape] = {
    "tiny-full": Shape(128, 4, 2, 32, 256, 512, "qwen3-8b", 256),
    "tiny-block10": Shape(128, 4, 2, 32, 256, 512, "llama3.1-8b", 256),
    "tiny-sliding": Shape(128, 4, 2, 64, 256, 512, "qwen3.6-27b", 256),
}
"""The grid's cases in miniature: all-full block 16, block 10, sliding + full layers (window 64)."""
MODES = {"attention": dict(compile_attention=True), "full": dict(compile_attention=True, compile_layers=True)}


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


def build(cfg: DrafterConfig, mode: str | None, device: torch.device, dtype: torch.dtype) -> DFlashDrafter:
    """One drafter; every call builds the same weights (seeded), so eager and compiled start equal."""
    torch.manual_seed(0)
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
    head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=dtype)
    nn.init.normal_(head.weight, std=0.02)
    flags: dict[str, Any] = dict(MODES[mode]) if mode else dict(compile_attention=False, compile_layers=False)
    model = DFlashDrafter(cfg, embed, head, fused_ce=mode == "full", **flags)
    return model.to(device=device, dtype=dtype).train()


def draw(cfg: DrafterConfig, budget: int, gen: torch.Generator, device, dtype) -> tuple[torch.Tensor, ...]:
    """One packed row as a run plans it: a length up to the budget, a random share of anchor positions."""
    length = int(torch.randint(budget // 4, budget + 1, (1,), generator=gen))
    share = float(torch.empty(1).uniform_(0.05, 1.0, generator=gen))
    ids = torch.randint(0, cfg.vocab_size - 1, (1, length), generator=gen)
    feats = torch.randn(1, length, cfg.feature_size, generator=gen) * 0.5
    mask = torch.rand(1, length, generator=gen) < share
    return ids.to(device), feats.to(device=device, dtype=dtype), mask.to(device)


def step(
    model: DFlashDrafter, inputs: tuple[torch.Tensor, ...], seed: int
) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of one step (no optimizer: both models stay at the same weights)."""
    model.zero_grad(set_to_none=True)
    gen = torch.Generator(device=inputs[0].device).manual_seed(seed)
    out = model(*inputs, generator=gen)
    out.loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(out.loss), grads


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def graphs_compiled() -> int:
    """Dynamo's count of compiled graphs so far (a private counter; -1 where a torch lacks it)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return -1
    return int(counters["stats"]["unique_graphs"])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sweep_shape(
    name: str, shape: Shape, args: argparse.Namespace, device, dtype, say
) -> list[dict[str, Any]]:
    cfg = drafter_config(shape, max_anchors=args.max_anchors, sliding_window=args.sliding_window)
    eager = build(cfg, None, device, dtype)
    rows = []
    for mode in args.modes:
        torch._dynamo.reset()
        model = build(cfg, mode, device, dtype)
        gen = torch.Generator().manual_seed(args.seed)
        for i in range(args.draws):
            inputs = draw(cfg, shape.budget, gen, device, dtype)
            row: dict[str, Any] = {
                "shape": name,
                "mode": mode,
                "draw": i,
                "tokens": inputs[0].shape[1],
                "anchor_share": round(float(inputs[2].float().mean()), 3),
                "block_size": cfg.block_size,
                "layer_types": ",".join(sorted(set(cfg.layer_types))),
            }
            try:
                ref_loss, ref_grads = step(eager, inputs, seed=i)
                before = graphs_compiled()
                sync(device)
                t0 = time.perf_counter()
                loss, grads = step(model, inputs, seed=i)
                sync(device)
                seconds = time.perf_counter() - t0
            except compiler_errors() + (RuntimeError,) as exc:
                row.update(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
                rows.append(row)
                say(f"{name} {mode} draw {i}: {row['error']}")
                continue
            flops = count_flops(model, inputs)["train_step"]
            row.update(
                loss_rel=relative(torch.tensor(loss), torch.tensor(ref_loss)),
                grad_rel_max=max(relative(grads[n], ref_grads[n]) for n in ref_grads),
                seconds=round(seconds, 4),
                new_graphs=graphs_compiled() - before if before >= 0 else None,
                mfu=round(flops / seconds / (PEAK_TFLOPS * 1e12), 4) if device.type == "cuda" else None,
            )
            row["within_tolerance"] = (
                row["loss_rel"] <= args.loss_tol and row["grad_rel_max"] <= args.grad_tol
            )
            rows.append(row)
            say(
                f"{name} {mode} draw {i}: {row['tokens']} tokens, loss rel {row['loss_rel']:.2e}, grad rel "
                f"{row['grad_rel_max']:.2e}, {seconds:.3f} s, {row['new_graphs']} new graph(s)"
            )
        del model
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"rows_failed": sum("error" in r for r in rows)}
    out["rows_outside_tolerance"] = sum(
        not r.get("within_tolerance", False) for r in rows if "error" not in r
    )
    for key in sorted({(r["shape"], r["mode"]) for r in rows}):
        mine = [r for r in rows if (r["shape"], r["mode"]) == key and "error" not in r]
        steady = [r["seconds"] for r in mine if not r["new_graphs"]]
        compiling = [r["seconds"] for r in mine if r["new_graphs"]]
        tag = f"{key[0]}_{key[1]}"
        out[f"{tag}_recompiling_draws"] = len(compiling)
        out[f"{tag}_steady_step_s"] = round(statistics.median(steady), 4) if steady else None
        out[f"{tag}_compile_share"] = (
            round(sum(compiling) / sum(r["seconds"] for r in mine), 3) if mine else None
        )
    return out


def main(argv: list[str] | None = None) -> BenchResult:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (fp32), what tests/bench runs")
    p.add_argument("--shapes", default=None, help=f"comma list of {', '.join(GRID)} (default: all)")
    p.add_argument("--modes", default="attention,full", help="comma list of attention, full")
    p.add_argument("--draws", type=int, default=4, help="context/anchor draws per shape and mode")
    p.add_argument("--max-anchors", type=int, default=512)
    p.add_argument("--sliding-window", type=int, default=None, help="override the presets' window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss-tol", type=float, default=None, help="default: 1e-2 in bf16, 1e-4 in fp32")
    p.add_argument("--grad-tol", type=float, default=None, help="default: 5e-2 in bf16, 1e-3 in fp32")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    grid = CPU_GRID if args.cpu else GRID
    names = list(grid) if not args.shapes else [s.strip() for s in args.shapes.split(",")]
    unknown = [n for n in names if n not in grid]
    if unknown:
        p.error(f"--shapes: unknown {unknown}; choose from {', '.join(grid)}")
    args.modes = [m.strip() for m in args.modes.split(",")]
    if bad := [m for m in args.modes if m not in MODES]:
        p.error(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    if args.cpu:
        args.max_anchors = min(args.max_anchors, 32)
        args.sliding_window = args.sliding_window or 64
    bf16 = dtype == torch.bfloat16
    args.loss_tol = args.loss_tol if args.loss_tol is not None else (1e-2 if bf16 else 1e-4)
    args.grad_tol = args.grad_tol if args.grad_tol is not None else (5e-2 if bf16 else 1e-3)
    apply_dynamo_settings()
    console = Console(stderr=True)
    rows = []
    for name in names:
        rows += sweep_shape(
            name, grid[name], args, device, dtype, lambda line: console.print(line, markup=False)
        )
    result = BenchResult(
        name="compile_sweep",
        config={
            "device": str(device),
            "dtype": str(dtype),
            "shapes": {n: asdict(grid[n]) for n in names},
            **{k: v for k, v in vars(args).items() if k not in ("out",)},
        },
        rows=rows,
        summary=summarize(rows),
    )
    save_result(result, args.out)
    show_result(result, console)
    return result


if __name__ == "__main__":
    main()
