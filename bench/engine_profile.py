"""Where a slot-engine decode step spends its time: captured-step milliseconds per (batch, span, attention
variant), and the kernel table of one eager step.

Run (H200):  PYTHONPATH=. python bench/engine_profile.py --out DIR
Writes DIR/engine_profile.json and DIR/engine_profile_kernels.txt.
"""

from __future__ import annotations

import argparse
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


def step_ms(stack: DecodeStack, batch: int, span: int, steps: int, graphs: bool, compiled: bool) -> float:
    cache = stack.new_cache(batch)
    state = SlotState(batch, 4096, [0], cache.trash, stack.device)
    state.done.zero_()
    state.limit.fill_(1 << 30)
    state.positions.fill_(span - steps - 8)
    state.tokens.random_(10, 1000)
    runner = StepGraphs(stack, cache, state, use_graphs=graphs, greedy=True, compile_step=compiled)
    runner.run(span)  # capture
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        runner.run(span)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-1.7b,qwen3-8b")
    p.add_argument("--batches", default="64,256")
    p.add_argument("--spans", default="256,768")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--variants", default="matmul,sdpa")
    p.add_argument("--compiled", default="0,1", help="0: eager step captured, 1: compiled step captured")
    p.add_argument("--kernels", type=int, default=1, help="1: the eager step's kernel table")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    tables = []
    for shape in args.shapes.split(","):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(qwen3_config(shape), dtype=torch.bfloat16).eval()
        for variant in args.variants.split(","):
            stack = DecodeStack(model, max_len=1024, decode_attention=variant)
            for compiled in [c == "1" for c in args.compiled.split(",")]:
                for batch in [int(b) for b in args.batches.split(",")]:
                    for span in [int(s) for s in args.spans.split(",")]:
                        t0 = time.perf_counter()
                        ms = step_ms(stack, batch, span, args.steps, graphs=True, compiled=compiled)
                        rows.append(
                            {"shape": shape, "attention": variant, "compiled": compiled, "batch": batch}
                            | {"span": span, "ms": ms, "setup_s": time.perf_counter() - t0}
                        )
                        print(json.dumps(rows[-1]), flush=True)
        if not args.kernels:
            continue
        stack = DecodeStack(model, max_len=1024)
        from torch.profiler import ProfilerActivity, profile

        cache = stack.new_cache(64)
        tokens = torch.randint(10, 1000, (64,), device="cuda")
        positions = torch.full((64,), 700, device="cuda")
        with torch.inference_mode():
            stack.step(cache, tokens, positions, 768)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    stack.step(cache, tokens, positions, 768)
                torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        tables.append(f"== {shape}, batch 64, span 768, eager matmul step x3\n{table}")
        print(tables[-1], flush=True)
        del model, stack
        torch.cuda.empty_cache()
    (args.out / "engine_profile.json").write_text(json.dumps(rows, indent=1))
    (args.out / "engine_profile_kernels.txt").write_text("\n".join(tables))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
