"""What a draft step costs launched kernel by kernel and replayed from a captured CUDA graph.

A random target built from a config.json folder (e.g. SmolLM2-135M's, no weights needed), a drafter of its
width, random prompts; real speculative decoding on the slot engine's stack, where each step's proposal comes
from the target's own greedy continuation ("oracle": every draft accepted, the fewest steps and the real
step cost) while the drafter runs its full forward. Per drafting kind, the drafter's milliseconds a step;
the drafts of the graphed and the step-by-step SDPA forward compared at every step; greedy decoding on the
same stack as the baseline of the speedup a drafter of that tau would give.

  PYTHONPATH=. python bench/draft_graphs.py --target-config DIR --out OUT [--dtype float32] [--prompts 4]
Writes OUT/draft_graphs.json (provenance, config, rows, summary).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_pipe.bench.result import BenchResult  # noqa: E402
from dflash_pipe.bench.save import save_result, show_result  # noqa: E402
from dflash_pipe.drafter import DFlashDrafter, DrafterConfig  # noqa: E402
from dflash_pipe.drafter.graphed_draft import GraphedProposer, attending  # noqa: E402
from dflash_pipe.drafter.speculate import (  # noqa: E402
    drafter_proposer,
    speculative_generate,
    stack_greedy_generate,
)


def build(config_dir: Path, device: torch.device, dtype: torch.dtype, draft_layers: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_dir))
    torch.manual_seed(0)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    target.eval().requires_grad_(False)
    cfg = DrafterConfig.from_target(config, num_layers=draft_layers, mask_token_id=config.vocab_size - 1)
    drafter = DFlashDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings())
    return target, drafter.to(device=device, dtype=dtype).eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target-config", type=Path, required=True, help="a folder with the target's config.json")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-layers", type=int, default=5)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target, drafter = build(args.target_config, device, getattr(torch, args.dtype), args.draft_layers)
    bs, layers = drafter.cfg.block_size, drafter.cfg.target_layer_ids
    g = torch.Generator().manual_seed(1)
    vocab = drafter.cfg.vocab_size - 1
    prompts = [torch.randint(0, vocab, (args.prompt_tokens,), generator=g) for _ in range(args.prompts + 1)]
    with torch.inference_mode():
        flex_eager = drafter_proposer(drafter) if device.type == "cuda" else None
        graphed = GraphedProposer(drafter)  # captures on CUDA, runs its buffers eagerly elsewhere
        eager = drafter_proposer(drafter)

        def sdpa_eager(tokens, features):
            with attending(drafter, "sdpa"):  # the same weights, the graphed path's attention
                return eager(tokens, features)

        kinds = {"graphed (SDPA)": graphed, "step by step, SDPA": sdpa_eager}
        if flex_eager is not None:
            kinds["step by step, flex (the training path)"] = flex_eager
        rows = []
        for i, prompt in enumerate(prompts):
            warm = i == 0  # the first prompt pays captures and compiles: not counted
            greedy = stack_greedy_generate(
                target, prompt, layer_ids=layers, max_new_tokens=args.max_new_tokens + bs
            )
            graphed.check = True  # every step's graphed draft against the step-by-step one, untimed
            speculative_generate(target, graphed, prompt, layer_ids=layers, block_size=bs, max_new_tokens=32)
            graphed.settle()
            graphed.check = False
            for kind, real in kinds.items():
                out = speculative_generate(
                    target,
                    oracle(real, greedy.tokens, prompt.numel()),
                    prompt,
                    layer_ids=layers,
                    block_size=bs,
                    max_new_tokens=args.max_new_tokens,
                )
                if not warm:
                    rows.append(
                        {
                            "kind": kind,
                            "steps": len(out.per_step),
                            "draft_ms_per_step": 1e3 * out.propose_seconds / len(out.per_step),
                            "verify_ms_per_step": 1e3 * out.verify_seconds / len(out.per_step),
                            "tokens_per_s": len(out.tokens) / out.seconds,
                            "greedy_tokens_per_s": len(greedy.tokens) / greedy.seconds,
                        }
                    )
    report = graphed.check_report()
    summary_rows = []
    for kind in kinds:
        mine = [r for r in rows if r["kind"] == kind]
        summary_rows.append(
            {"kind": kind, **{k: statistics.mean(r[k] for r in mine) for k in mine[0] if k != "kind"}}
        )
    result = BenchResult(
        name="draft_graphs",
        config={**{k: str(v) for k, v in vars(args).items()}, "device": str(device), "block_size": bs},
        rows=summary_rows,
        summary={
            "graphed_drafts_differing": report["mismatched"],
            "steps_compared": report["checked"],
            "first_differing": report["first"],
        },
    )
    save_result(result, args.out)
    show_result(result, Console())


def oracle(real, greedy: list[int], prompt_len: int):
    """Runs the drafter (its cost), proposes the target's greedy continuation (every draft accepted)."""

    def propose(tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        drafted = real(tokens, features)
        done = tokens.numel() - prompt_len
        return torch.tensor(greedy[done : done + drafted.numel()], device=drafted.device)

    return propose


if __name__ == "__main__":
    main()
