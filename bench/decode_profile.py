"""Where one-token decoding spends its time: HF ``generate`` of a random target, then a torch.profiler table.

Decoding one token runs every layer's small kernels once; when the host cannot launch them as fast as the GPU
runs them, the step time is set by the CPU, not by the model's size. This says which it is on a machine:
  PYTHONPATH=. python bench/decode_profile.py --shape qwen3-1.7b > OUT.txt
(the H200 run: bench/results/h200_regenerate_speed/decode_profile.txt).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_target import SHAPES, qwen3_config  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    p.add_argument("--prompt-len", type=int, default=512)
    args = p.parse_args()
    print(
        f"cpus {os.cpu_count()}, load {os.getloadavg()}, torch threads {torch.get_num_threads()}", flush=True
    )
    a = torch.randn(64, 64, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2000):
        a = a + 1
    torch.cuda.synchronize()
    print(f"2000 tiny CUDA adds: {(time.perf_counter() - t0) * 1e3:.1f} ms (the launch rate)", flush=True)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            qwen3_config(args.shape), dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    model.eval().requires_grad_(False)
    ids = torch.randint(0, 1000, (1, args.prompt_len), device="cuda")

    def generate(n: int) -> None:
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )

    for n in (8, 32):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        generate(n)
        torch.cuda.synchronize()
        print(f"generate {n} tokens: {time.perf_counter() - t0:.2f} s", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate(8)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), flush=True)


if __name__ == "__main__":
    main()
