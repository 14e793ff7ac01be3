"""``dflash-pipe eval``: the acceptance length (tau) of an exported drafter against its target, by real
speculative decoding (checked lossless against greedy decoding) or simulated (teacher-forced)."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from dflash_pipe.commands import console


@click.command("eval")
@click.option(
    "--target-model",
    type=click.Path(exists=True, path_type=Path),
    required=True,
    help="HF model directory of the target, or a GGUF file (converted once to a cached HF folder).",
)
@click.option(
    "--drafter",
    "drafter_dir",
    type=click.Path(exists=True, path_type=Path),
    required=True,
    help="Exported drafter directory (see `export`).",
)
@click.option(
    "--data",
    "data_path",
    type=click.Path(exists=True, path_type=Path),
    required=True,
    help="JSONL samples to evaluate on.",
)
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda:N.")
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16"]),
    default="auto",
    show_default=True,
    help="generate: the target's and drafter's dtype. auto: bf16 on CUDA (as trained), fp32 on CPU. In bf16 "
    "the target's block verify and its one-token decode round differently, so near-ties can flip a greedy "
    "token and fail the lossless check whatever the drafter; float32 makes the check exact.",
)
@click.option(
    "--mode",
    type=click.Choice(["generate", "simulated"]),
    default="generate",
    show_default=True,
    help="generate: real speculative decoding of the samples' prompts, checked lossless against greedy "
    "decoding; simulated: the fast teacher-forced tau on the samples' own text.",
)
@click.option(
    "--max-samples",
    type=int,
    help="Evaluate at most this many samples (default: 16 prompts for generate, 256 samples for simulated).",
)
@click.option(
    "--max-new-tokens",
    type=int,
    default=256,
    show_default=True,
    help="generate: each answer stops at its end-of-turn token or after this many tokens.",
)
@click.option(
    "--check/--no-check",
    default=True,
    show_default=True,
    help="generate: also decode each prompt greedily with the target and fail unless the outputs are equal "
    "(about triples the time: HF `generate` for the check, greedy decoding on the verify stack for the "
    "speedup's baseline).",
)
@click.option(
    "--num-anchors", type=int, default=64, show_default=True, help="simulated: blocks per sequence."
)
@click.option("--max-length", type=int, default=3072, show_default=True, help="Longer samples are truncated.")
@click.option(
    "--out",
    "out_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the result (metrics, command, versions) to this JSON file.",
)
def eval_cmd(
    target_model: Path,
    drafter_dir: Path,
    data_path: Path,
    device: str,
    mode: str,
    max_samples: int | None,
    max_new_tokens: int,
    check: bool,
    dtype: str,
    num_anchors: int,
    max_length: int,
    out_file: Path | None,
) -> None:
    """Acceptance length (tau) of a drafter against its target: real, or simulated.

    generate (default): real greedy speculative decoding as it is served. For each sample's prompt (its turns
    before the first assistant turn) the target prefills, the drafter drafts a block from the target's
    features, the target verifies it in one forward on its KV cache, the matching prefix plus the target's
    own token is kept; to the end of the turn. tau = tokens per draft-verify step (the bonus included), per
    draft position the share of steps that kept it, tokens/s; the output must equal the target's greedy
    decoding (exit status 1 if not). simulated: teacher-forced on the samples' own text at sampled anchors
    (fast; overstates tau when the data is not what the target says).

    \b
    Examples:
      dflash-pipe eval --target-model /models/Qwen3-8B --drafter out/qwen3-8b-dflash --data eval.jsonl
      dflash-pipe eval ... --mode simulated --max-samples 256
    """
    import json

    import torch
    from transformers import AutoTokenizer

    from dflash_pipe.data import DataConfig, load_samples
    from dflash_pipe.drafter.speculate import CacheCropError, LosslessError
    from dflash_pipe.target.gguf import resolve_target

    for name, value in (("--max-samples", max_samples), ("--max-new-tokens", max_new_tokens)):
        if value is not None and value < 1:
            raise click.UsageError(f"{name} must be >= 1, got {value}.")
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    limit = max_samples or (16 if mode == "generate" else 256)
    given_target = target_model
    try:  # a damaged export, a drafter that does not fit the target, or bad data: one line naming the input
        target_model = resolve_target(target_model)  # a GGUF file: its converted folder (TargetPathError)
        tokenizer = AutoTokenizer.from_pretrained(str(target_model))
        data = load_samples(DataConfig(path=data_path, max_length=max_length), tokenizer)
        if mode == "generate":
            from dflash_pipe.drafter.generate_eval import evaluate_export, render_generate_table

            result = evaluate_export(
                target_model,
                drafter_dir,
                data.samples,
                tokenizer=tokenizer,
                device=dev,
                max_prompts=limit,
                max_new_tokens=max_new_tokens,
                check=check,
                progress=console.is_terminal,
                warn=_warn,
                dtype=None if dtype == "auto" else getattr(torch, dtype),
            )
            Console().print(render_generate_table(result))
            metrics = result.metrics()
        else:
            from dflash_pipe.drafter.evaluate import render_acceptance_table, simulate_export

            simulated = simulate_export(
                target_model,
                drafter_dir,
                data.samples[:limit],
                device=dev,
                num_anchors=num_anchors,
                progress=console.is_terminal,
                warn=_warn,
            )
            Console().print(render_acceptance_table(simulated))
            metrics = simulated.metrics()
    except (ValueError, OSError) as exc:  # DataError and ExportError are ValueErrors
        raise click.ClickException(str(exc)) from None
    except (LosslessError, CacheCropError) as exc:  # the one number would be wrong: say so and fail
        raise click.ClickException(str(exc)) from None
    if out_file is not None:
        from dflash_pipe.bench.save import provenance

        record = {
            "mode": mode,
            "command": sys.argv,
            "target_model": str(given_target),
            **({"target_folder": str(target_model)} if str(target_model) != str(given_target) else {}),
            "drafter": str(drafter_dir),
            "data": str(data_path),
            "dtype": dtype,
            "metrics": metrics,
            "provenance": provenance(),
        }
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(json.dumps(record, indent=2) + "\n")
        console.print(f"wrote {out_file}")
    if mode == "generate":  # every prompt ran and the record is written: now fail loudly on a mismatch
        try:
            result.check_lossless()
        except LosslessError as exc:
            raise click.ClickException(str(exc)) from None


def _warn(note: str) -> None:
    console.print(f"[yellow]warning:[/] {escape(note)}")
