"""Regeneration speed: generated tokens/s of the batched regeneration path against plain HF ``generate`` one
conversation at a time, and the time from launch to the first trained step with ``--responses target``.

Run (H200, one line; random targets at the Qwen3-1.7B and 8B shapes, nothing downloaded):
  PYTHONPATH=. python bench/regenerate_speed.py --device cuda --out bench/results/h200_regenerate_speed
CPU (seconds, the demo target's shape; what tests/bench runs):
  PYTHONPATH=. python bench/regenerate_speed.py --device cpu --shapes demo --prompts 32 --batch-sizes 1,32 \\
      --hf-prompts 8 --new-tokens 32 --prompt-tokens 128 --launch-shapes none --out DIR
  add --launch-shapes demo to time the embedded demo's launch (its target and data) on CPU.

Writes DIR/regenerate_speed.json (+ .png). Generation rows: random prompts of --prompt-tokens (half to all
of it), --new-tokens per reply; the random weights rarely write an end-of-turn token, so replies run to
the limit in both paths, and the figure is the tokens each path really generated over its wall time.
``same_as_hf`` counts the prompts whose greedy reply (largest batch) is identical to HF's one-at-a-time one.
Launch rows: ``dflash-pipe launch --max-steps 2`` on the demo conversations, ``--responses target`` and
``--responses dataset``, timed from the process start to its first logged loss; at a model shape the target
is saved with that shape's layers but the demo tokenizer's vocabulary (the replies must decode to text),
and replies are capped at 256 tokens (random weights never end a turn).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_target import SHAPES, qwen3_config  # noqa: E402

from dflash_pipe.bench.result import BenchResult  # noqa: E402
from dflash_pipe.bench.save import save_result, show_result  # noqa: E402
from dflash_pipe.data import demo_data_path, demo_tokenizer  # noqa: E402
from dflash_pipe.data.config import RegenConfig  # noqa: E402
from dflash_pipe.target.demo import demo_model_config  # noqa: E402
from dflash_pipe.target.generate import TurnGenerator  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def random_prompts(n: int, tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, tokens // 2), tokens + 1, (n,), generator=g).tolist()
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for length in lengths]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def generation_rows(
    shape: str,
    device: str,
    prompts: int,
    prompt_tokens: int,
    new_tokens: int,
    batch_sizes: list[int],
    hf_prompts: int,
) -> list[dict[str, Any]]:
    """Batched regeneration decoding at each batch size over ``prompts`` prompts, and HF generate one prompt
    at a time over the first ``hf_prompts`` of them."""
    tokenizer = demo_tokenizer()
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    config = demo_model_config(tokenizer) if shape == "demo" else qwen3_config(shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    work = random_prompts(prompts, prompt_tokens, model.config.vocab_size)
    gen = TurnGenerator(
        model,
        tokenizer,
        RegenConfig(max_new_tokens=new_tokens, batch_size=max(batch_sizes)),
        device=device,
        max_length=2 * prompt_tokens + new_tokens,
    )
    gen.generate([work[0]], [2])  # warm-up: kernels, allocator
    rows = []
    first: list[list[int]] = []  # the largest batch's replies to the prompts HF answers too
    for batch in batch_sizes:
        _sync(device)
        t0 = time.perf_counter()
        made = 0
        first = []
        for start in range(0, len(work), batch):
            chunk = work[start : start + batch]
            replies = gen.generate(chunk, [new_tokens] * len(chunk))
            made += sum(len(r.tokens) + int(r.ended) for r in replies)
            first += [r.tokens for r in replies][: max(0, hf_prompts - len(first))]
        _sync(device)
        rows.append(
            _row(shape, f"regeneration, batch {batch}", batch, made, time.perf_counter() - t0, device)
        )
        print(f"  {shape} batch {batch}: {rows[-1]['tokens_per_s']} tokens/s", file=sys.stderr, flush=True)
    _sync(device)
    t0 = time.perf_counter()
    made = 0
    same = 0
    with torch.inference_mode():
        for i, prompt in enumerate(work[:hf_prompts]):
            ids = torch.tensor([prompt], device=device)
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=gen.end_ids,
                pad_token_id=gen.pad_id,
            )
            made += out.shape[1] - ids.shape[1]
            reply = out[0, ids.shape[1] :].tolist()
            if reply and reply[-1] in gen.end_ids:
                reply = reply[:-1]
            same += int(reply == first[i])
    _sync(device)
    rows.append(_row(shape, "HF generate, one at a time", 1, made, time.perf_counter() - t0, device))
    for row in rows:  # greedy replies of the largest batch identical to HF's, prompt by prompt
        row["same_as_hf"] = f"{same}/{min(hf_prompts, len(work))}"
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def _row(shape: str, path: str, batch: int, tokens: int, seconds: float, device: str) -> dict[str, Any]:
    return {
        "part": "generation",
        "shape": shape,
        "path": path,
        "batch": batch,
        "generated_tokens": int(tokens),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
        "time_to_first_step_s": None,
        "device": device,
        "same_as_hf": None,
    }


def launch_rows(shape: str, device: str, scratch: Path, extra: list[str]) -> list[dict[str, Any]]:
    """Seconds from ``dflash-pipe launch`` starting to its first logged loss, target vs dataset responses."""
    args = ["--max-steps", "2", "--device", "cuda" if device.startswith("cuda") else "cpu", *extra]
    if shape != "demo":
        target = scratch / f"target-{shape}"
        if not (target / "config.json").exists():
            config = qwen3_config(shape)
            config.vocab_size = len(demo_tokenizer())  # the replies must decode to the tokenizer's text
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            model.save_pretrained(target)
            demo_tokenizer().save_pretrained(target)
            del model
        args += ["--target-model", str(target), "--data", str(demo_data_path()), "--max-length", "1024"]
        args += ["--max-new-tokens", "128"]  # random weights never end a turn: every reply is this long
    rows = []
    for responses in ("target", "dataset"):
        run_dir = scratch / f"run-{shape}-{responses}"
        shutil.rmtree(run_dir, ignore_errors=True)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        cmd = [sys.executable, "-m", "dflash_pipe", "launch", "--plain", "--run-dir", str(run_dir)]
        t0 = time.time()
        # the launch's own output streams through (a run cut by a timeout still shows how far it got)
        done = subprocess.run([*cmd, "--responses", responses, *args], env=env, stdout=sys.stderr)
        if done.returncode != 0:
            raise RuntimeError(f"launch --responses {responses} failed (exit {done.returncode}): see above")
        first = next(
            json.loads(line)["time"]
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line
        )
        rows.append(
            {
                "part": "launch",
                "shape": shape,
                "path": f"launch --responses {responses}",
                "batch": RegenConfig().batch_size if responses == "target" else 0,
                "generated_tokens": None,
                "seconds": round(time.time() - t0, 2),
                "tokens_per_s": None,
                "time_to_first_step_s": round(first - t0, 2),
                "device": device,
                "same_as_hf": None,
            }
        )
    return rows


def _csv(text: str) -> list[str]:
    return [] if text in ("", "none") else [t.strip() for t in text.split(",") if t.strip()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--shapes",
        default="qwen3-1.7b,qwen3-8b",
        help=f"of demo (the demo target's), {', '.join(sorted(SHAPES))}",
    )
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batch-sizes", default="8,64")
    p.add_argument("--hf-prompts", type=int, default=8, help="prompts for the one-at-a-time HF baseline")
    p.add_argument("--launch-shapes", default="qwen3-1.7b", help="shapes (or demo) to time launch for; none")
    p.add_argument("--launch-args", default=None, help="extra launch flags (default cuda: one GPU for both)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default on CPU: 1, what launch gives the producer on a 2-core machine)",
    )
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.threads or args.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    device = f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else args.device
    batch_sizes = [int(b) for b in _csv(args.batch_sizes)]
    rows: list[dict[str, Any]] = []
    console = Console(stderr=True)
    for shape in _csv(args.shapes):
        console.print(f"generation at the {shape} shape on {device} ...")
        rows += generation_rows(
            shape, device, args.prompts, args.prompt_tokens, args.new_tokens, batch_sizes, args.hf_prompts
        )
    extra = (
        args.launch_args or ("--target-gpus 0 --drafter-gpus 0" if args.device == "cuda" else "")
    ).split()
    with tempfile.TemporaryDirectory(prefix="regen-bench-") as scratch:
        for shape in _csv(args.launch_shapes):
            console.print(f"launch to the first step ({shape}) ...")
            rows += launch_rows(shape, device, Path(scratch), extra)
    summary: dict[str, Any] = {}
    for shape in _csv(args.shapes):
        mine = [r for r in rows if r["shape"] == shape and r["part"] == "generation"]
        best = max((r for r in mine if r["path"].startswith("regeneration")), key=lambda r: r["tokens_per_s"])
        hf = next(r for r in mine if r["path"].startswith("HF"))
        summary[f"{shape}_best_tokens_per_s"] = best["tokens_per_s"]
        summary[f"{shape}_best_batch"] = best["batch"]
        summary[f"{shape}_hf_one_at_a_time_tokens_per_s"] = hf["tokens_per_s"]
        summary[f"{shape}_speedup_vs_hf"] = round(best["tokens_per_s"] / hf["tokens_per_s"], 2)
        summary[f"{shape}_greedy_same_as_hf"] = hf["same_as_hf"]
    for r in rows:
        if r["part"] == "launch":
            summary[f"{r['shape']}_{r['path'].split()[-1]}_time_to_first_step_s"] = r["time_to_first_step_s"]
    result = BenchResult(
        name="regenerate_speed",
        config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        rows=rows,
        summary=summary,
        chart={
            "x": "batch",
            "y": "tokens_per_s",
            "group": "shape",
            "title": "regeneration tokens/s by batch",
        },
    )
    save_result(result, args.out)
    show_result(result, Console())


if __name__ == "__main__":
    main()
