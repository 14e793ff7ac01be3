"""What the real evaluation costs per held-out prompt: speculative decoding and its greedy reference.

Run on the H200 (random-initialised target of a real shape, a 5-layer drafter of its width; no downloads):
  PYTHONPATH=. python bench/spec_eval_cost.py --shape qwen3-8b --out DIR
CPU mode (tiny shapes, seconds; what tests/bench runs):
  PYTHONPATH=. python bench/spec_eval_cost.py --cpu --out DIR
Writes DIR/spec_eval_cost.json (provenance, config, rows, summary) and DIR/spec_eval_cost.png.

A random drafter's drafts are almost never accepted (tau ~ 1: one step per token, the most steps a prompt
can take); "oracle" runs the same drafter forward each step but proposes the target's own greedy tokens
(tau = block size: the fewest steps). A trained drafter's cost per prompt lies between the two rows. The
"greedy" row is the lossless check's reference decoding (HF generate), computed once per prompt and run.
Random weights have flat logits, so bf16 near-ties can make the block forward and the one-token forward pick
different tokens: the rows count such prompts (``not_lossless``) instead of failing.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

from dflash_pipe.bench.result import BenchResult
from dflash_pipe.bench.save import save_result, show_result
from dflash_pipe.drafter import DFlashDrafter, DrafterConfig
from dflash_pipe.drafter.speculate import (
    Proposer,
    drafter_proposer,
    greedy_generate,
    speculative_generate,
)


def _load_make_target():
    """bench/make_target.py (its shapes), by path: bench/ is a folder of scripts, not a package."""
    spec = importlib.util.spec_from_file_location("make_target", Path(__file__).with_name("make_target.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_make_target = _load_make_target()
SHAPES, qwen3_config = _make_target.SHAPES, _make_target.qwen3_config


def build(
    shape: str, device: torch.device, *, cpu_tiny: bool, draft_layers: int, block_size: int, attention: str
):
    """A random target of ``shape`` (bf16 on CUDA) and a random drafter of its width sharing its embedding."""
    from transformers import AutoModelForCausalLM

    config = qwen3_config(shape)
    if cpu_tiny:
        config.vocab_size, config.num_hidden_layers = 2048, 6
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    target.eval().requires_grad_(False)
    cfg = DrafterConfig.from_target(
        config,
        num_layers=draft_layers,
        block_size=block_size,
        mask_token_id=config.vocab_size - 1,
        attention_backend=attention,
    )
    drafter = DFlashDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings())
    drafter.to(device=device, dtype=dtype).eval()
    return target, drafter


def oracle_proposer(real: Proposer, greedy: list[int], prompt_len: int) -> Proposer:
    """Runs the drafter (its cost) and proposes the target's greedy continuation instead (all accepted)."""

    def propose(tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        drafted = real(tokens, features)  # [bs-1]
        done = tokens.numel() - prompt_len
        out = greedy[done : done + drafted.numel()]
        return torch.tensor(out + [0] * (drafted.numel() - len(out)), device=drafted.device)

    return propose


def measure(target, drafter, prompts: list[torch.Tensor], max_new_tokens: int) -> list[dict]:
    """One row per drafting kind, one for greedy decoding: per-prompt means."""
    layer_ids, bs = drafter.cfg.target_layer_ids, drafter.cfg.block_size
    real = drafter_proposer(drafter)
    per_kind: dict[str, list[dict]] = {"random drafter": [], "oracle drafts": [], "greedy (the check)": []}
    for n, prompt in enumerate(prompts, 1):
        started = time.perf_counter()
        greedy = greedy_generate(target, prompt, max_new_tokens=max_new_tokens)
        horizon = greedy_generate(target, prompt, max_new_tokens=max_new_tokens + bs).tokens
        per_kind["greedy (the check)"].append(
            {
                "seconds": greedy.seconds,
                "target_forwards": len(greedy.tokens),
                "drafter_forwards": 0,
                "tokens": len(greedy.tokens),
                "tau": None,
                "prefill_s": None,
                "propose_s": None,
                "verify_s": None,
                "not_lossless": 0,
            }
        )
        for kind, propose in (
            ("random drafter", real),
            ("oracle drafts", oracle_proposer(real, horizon, prompt.numel())),
        ):
            out = speculative_generate(
                target, propose, prompt, layer_ids=layer_ids, block_size=bs, max_new_tokens=max_new_tokens
            )
            per_kind[kind].append(
                {
                    "seconds": out.seconds,
                    "target_forwards": out.target_forwards,
                    "drafter_forwards": out.drafter_forwards,
                    "tokens": len(out.tokens),
                    "tau": out.counts.tau,
                    "prefill_s": out.prefill_seconds,
                    "propose_s": out.propose_seconds,
                    "verify_s": out.verify_seconds,
                    "not_lossless": int(out.tokens != greedy.tokens),
                }
            )
        print(  # progress: a GPU run can take minutes, and a killed one should say how far it got
            f"prompt {n}/{len(prompts)}: {time.perf_counter() - started:.1f} s "
            f"(greedy {greedy.seconds:.1f} s, random drafter {per_kind['random drafter'][-1]['seconds']:.1f} s, "
            f"oracle {per_kind['oracle drafts'][-1]['seconds']:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    rows = []
    for kind, runs in per_kind.items():
        seconds = statistics.fmean(r["seconds"] for r in runs)
        tokens = statistics.fmean(r["tokens"] for r in runs)
        taus = [r["tau"] for r in runs if r["tau"] is not None]
        prefill = [r["prefill_s"] for r in runs if r["prefill_s"] is not None]
        propose = [r["propose_s"] for r in runs if r["propose_s"] is not None]
        verify = [r["verify_s"] for r in runs if r["verify_s"] is not None]
        rows.append(
            {
                "decoding": kind,
                "seconds_per_prompt": round(seconds, 4),
                "tokens_per_prompt": round(tokens, 1),
                "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
                "target_forwards_per_prompt": round(statistics.fmean(r["target_forwards"] for r in runs), 1),
                "drafter_forwards_per_prompt": round(
                    statistics.fmean(r["drafter_forwards"] for r in runs), 1
                ),
                "tau": round(statistics.fmean(taus), 3) if taus else None,
                "prefill_s": round(statistics.fmean(prefill), 4) if prefill else None,
                "propose_s": round(statistics.fmean(propose), 4) if propose else None,
                "verify_s": round(statistics.fmean(verify), 4) if verify else None,
                "not_lossless": sum(r["not_lossless"] for r in runs),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> BenchResult:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shape", choices=sorted(SHAPES), default="qwen3-8b", help="target shape (bench/make_target.py)"
    )
    p.add_argument("--cpu", action="store_true", help="CPU mode: tiny shapes, a few seconds")
    p.add_argument("--prompts", type=int, default=4, help="timed prompts (after one warm-up prompt)")
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt (random ids)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer (no end-of-turn stop)")
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--attention", choices=["auto", "flex", "sdpa"], default="auto", help="drafter attention")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.cpu:
        args.shape = "qwen3-tiny"
        args.prompts, args.prompt_len, args.max_new_tokens = (
            min(args.prompts, 2),
            min(args.prompt_len, 48),
            min(args.max_new_tokens, 24),
        )
        args.draft_layers, args.block_size = min(args.draft_layers, 2), min(args.block_size, 8)
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    built = time.perf_counter()
    target, drafter = build(
        args.shape,
        device,
        cpu_tiny=args.cpu,
        draft_layers=args.draft_layers,
        block_size=args.block_size,
        attention=args.attention,
    )
    print(
        f"{args.shape} target and drafter built in {time.perf_counter() - built:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    gen = torch.Generator().manual_seed(0)
    vocab = drafter.cfg.vocab_size - 1  # the last row is the mask token
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen) for _ in range(args.prompts + 1)]
    t0 = time.perf_counter()
    measure(target, drafter, prompts[:1], args.max_new_tokens)  # warm-up: compiles, allocator, caches
    warmup_s = time.perf_counter() - t0
    rows = measure(target, drafter, prompts[1:], args.max_new_tokens)
    by = {r["decoding"]: r for r in rows}
    greedy_s = by["greedy (the check)"]["seconds_per_prompt"]
    result = BenchResult(
        name="spec_eval_cost",
        config={
            "shape": args.shape + (" (tiny CPU variant: vocab 2048, 6 layers)" if args.cpu else ""),
            "device": str(device),
            "dtype": str(next(target.parameters()).dtype),
            "target_params_b": round(sum(p.numel() for p in target.parameters()) / 1e9, 3),
            "drafter_layers": args.draft_layers,
            "block_size": args.block_size,
            "drafter_attention": drafter.backend(device),
            "prompts": args.prompts,
            "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new_tokens,
        },
        rows=rows,
        summary={
            "warmup_s": round(warmup_s, 2),
            "real_eval_s_per_prompt_tau1_with_check": round(
                by["random drafter"]["seconds_per_prompt"] + greedy_s, 3
            ),
            "real_eval_s_per_prompt_taubs_with_check": round(
                by["oracle drafts"]["seconds_per_prompt"] + greedy_s, 3
            ),
            "oracle_speedup_vs_greedy": round(greedy_s / by["oracle drafts"]["seconds_per_prompt"], 2),
            "random_drafter_slowdown_vs_greedy": round(
                by["random drafter"]["seconds_per_prompt"] / greedy_s, 2
            ),
        },
        chart={
            "x": "decoding",
            "y": "seconds_per_prompt",
            "kind": "bar",
            "title": "seconds per held-out prompt",
        },
    )
    save_result(result, args.out)
    show_result(result, Console(stderr=True))
    return result


if __name__ == "__main__":
    main()
