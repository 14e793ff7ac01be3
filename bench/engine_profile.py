"""Where a slot-engine decode step spends its time: captured-step milliseconds per (batch, span, attention
variant, eager or compiled layers), prefill milliseconds per (rows, row length, eager or compiled), the
first call's compile seconds, and the kernel tables of a compiled step and a compiled prefill.

Run (H200):  PYTHONPATH=. python bench/engine_profile.py --out DIR
Writes DIR/engine_profile.json and DIR/engine_profile_kernels.txt.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_target import qwen3_config  # noqa: E402

from dflash_pipe.target.decode.slots import SlotState, StepGraphs  # noqa: E402
from dflash_pipe.target.decode.stack import DecodeStack  # noqa: E402


def step_ms(stack: DecodeStack, batch: int, span: int, steps: int, graphs: bool) -> float:
    cache = stack.new_cache(batch)
    state = SlotState(batch, 4096, [0], cache.trash, stack.device)
    state.done.zero_()
    state.limit.fill_(1 << 30)
    state.positions.fill_(span - steps - 8)
    state.tokens.random_(10, 1000)
    runner = StepGraphs(stack, cache, state, use_graphs=graphs, greedy=True)
    runner.run(span)  # capture
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        runner.run(span)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def prefill_ms(stack: DecodeStack, rows: int, length: int, repeats: int = 5) -> float:
    cache = stack.new_cache(rows)
    seqs = [torch.randint(10, 1000, (length,)).tolist() for _ in range(rows)]
    stack.prefill(cache, list(range(rows)), seqs, [0] * rows)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        stack.prefill(cache, list(range(rows)), seqs, [0] * rows)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e3


def kernel_table(title: str, fn, repeats: int = 3) -> str:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    return f"== {title} x{repeats}\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-1.7b,qwen3-8b")
    p.add_argument("--batches", default="64,256")
    p.add_argument("--spans", default="512,768")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--variants", default="sdpa,matmul")
    p.add_argument("--compiled", default="0,1", help="0: eager layers captured, 1: compiled layers captured")
    p.add_argument("--prefill", default="32x512,64x384", help="ROWSxLENGTH prefill calls timed")
    p.add_argument("--kernels", type=int, default=1, help="1: kernel tables of a compiled step and prefill")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    tables = []

    def record(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        (args.out / "engine_profile.json").write_text(json.dumps(rows, indent=1))

    for shape in args.shapes.split(","):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(qwen3_config(shape), dtype=torch.bfloat16).eval()
        for variant in args.variants.split(","):
            for compiled in [c == "1" for c in args.compiled.split(",")]:
                stack = DecodeStack(model, max_len=1024, decode_attention=variant, compile_layers=compiled)
                for batch in [int(b) for b in args.batches.split(",")]:
                    for span in [int(s) for s in args.spans.split(",")]:
                        t0 = time.perf_counter()
                        ms = step_ms(stack, batch, span, args.steps, graphs=True)
                        record(
                            {"shape": shape, "attention": variant, "compiled": compiled, "batch": batch}
                            | {"span": span, "ms": ms, "setup_s": time.perf_counter() - t0}
                        )
                if variant != args.variants.split(",")[0]:
                    continue
                for spec in args.prefill.split(","):
                    n_rows, length = (int(x) for x in spec.split("x"))
                    t0 = time.perf_counter()
                    ms = prefill_ms(stack, n_rows, length)
                    record(
                        {"shape": shape, "prefill": spec, "compiled": compiled, "ms": ms}
                        | {
                            "tokens_per_s": round(n_rows * length / ms * 1e3),
                            "setup_s": time.perf_counter() - t0,
                        }
                    )
        if args.kernels:
            stack = DecodeStack(model, max_len=1024, compile_layers=True)
            cache = stack.new_cache(64)
            tokens = torch.randint(10, 1000, (64,), device="cuda")
            positions = torch.full((64,), 700, device="cuda")
            tables.append(
                kernel_table(
                    f"{shape}, batch 64, span 768, compiled step (not captured)",
                    functools.partial(stack.step, cache, tokens, positions, 768),
                )
            )
            seqs = [torch.randint(10, 1000, (512,)).tolist() for _ in range(32)]
            prefill_cache = stack.new_cache(32)
            tables.append(
                kernel_table(
                    f"{shape}, 32 x 512 fresh prefill, compiled",
                    functools.partial(stack.prefill, prefill_cache, list(range(32)), seqs, [0] * 32),
                )
            )
            print(tables[-2] + "\n" + tables[-1], flush=True)
            (args.out / "engine_profile_kernels.txt").write_text("\n".join(tables))
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    with torch.inference_mode():
        main()
