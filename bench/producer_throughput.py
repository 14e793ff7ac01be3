"""Producer throughput: the producer's target path against a plain HF forward of the same samples, one run.

Run (H200, ~3 min): PYTHONPATH=. python bench/producer_throughput.py --out DIR
CPU smoke test:     PYTHONPATH=. python bench/producer_throughput.py --out DIR --shape qwen3-tiny --batches 3

The target is a randomly initialised model of a real shape (``make_target.SHAPES``), built from its config
on the device. Samples have seeded random lengths in [--min-len, --max-len] and random tokens; batches come
from ``plan_batches`` with the launch's token budget, exactly as the producer plans them. Both paths run the
same batches:

- producer: ``TargetThread`` over a ``TargetCore`` (packed row, flex_attention on CUDA, forward stopped after
  the deepest selected layer, no LM head), features copied into pinned ``PrivateStaging`` slots on a side
  stream while the next batch computes; slots released as they arrive (what the ACK does).
- plain: the whole model (all layers + LM head) on right-padded rows with ``output_hidden_states=True``, the
  selected layers concatenated, padding dropped and copied to the host with ``.cpu()`` (an offline dumper).

Writes DIR/producer_throughput.json: tokens/s of both, their ratio, the producer's MFU against 790 TFLOP/s
(FLOPs of the layers actually run; attention counted over each sample's causal triangle only), peak memory,
and the largest feature difference between the two paths, with provenance (git SHA, versions, GPU, config).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import queue
import resource
import time
from pathlib import Path

import numpy as np
import torch
from drafter_step import PEAK_TFLOPS
from make_target import SHAPES, qwen3_config

from dflash_pipe.bench import BenchResult
from dflash_pipe.bench.save import provenance
from dflash_pipe.config.drafter import default_target_layer_ids
from dflash_pipe.data import Sample, plan_batches
from dflash_pipe.data.config import DataConfig
from dflash_pipe.producer.scheduler import PlannedBatch
from dflash_pipe.producer.target_threads import TargetFailure, TargetThread
from dflash_pipe.target import TargetCore
from dflash_pipe.telemetry import RateMeter
from dflash_pipe.wire.slots import PrivateStaging

GOAL_SPEEDUP = 1.3
GOAL_MFU = 0.55
COMPARED_BATCHES = 2
"""Batches whose features are kept from both paths and compared."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output directory for producer_throughput.json")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", type=int, default=64, help="timed batches (the same ones on both paths)")
    p.add_argument("--warmup", type=int, default=3, help="untimed batches first (flex compile, allocator)")
    budget = DataConfig(path=Path("-")).token_budget
    p.add_argument("--token-budget", type=int, default=budget, help=f"as launch --token-budget ({budget})")
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=3072)
    p.add_argument(
        "--draft-layers", type=int, default=5, help="selected layers: the drafter default for this"
    )
    p.add_argument("--attention", choices=["auto", "flex", "sdpa"], default="auto")
    p.add_argument(
        "--compile-layers",
        choices=["auto", "on", "off"],
        default="auto",
        help="decoder layers through one compiled function (auto: TargetCore's default, on with CUDA flex)",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_batches(args: argparse.Namespace, vocab: int) -> tuple[list[Sample], list[PlannedBatch]]:
    """Seeded samples, planned by the producer's planner; enough of them for warm-up + timed batches."""
    rng = np.random.default_rng(args.seed)
    mean = (args.min_len + args.max_len) / 2
    count = int((args.warmup + args.batches + 2) * max(args.token_budget, args.max_len) / mean * 1.5) + 8
    lengths = rng.integers(args.min_len, args.max_len + 1, size=count)
    samples = [
        Sample(
            sample_id=i,
            input_ids=torch.from_numpy(rng.integers(0, vocab, size=int(n))),
            loss_mask=torch.ones(int(n), dtype=torch.bool),
        )
        for i, n in enumerate(lengths)
    ]
    plans = plan_batches(lengths.tolist(), args.token_budget, seed=args.seed, epoch=0)
    needed = args.warmup + args.batches
    if len(plans) < needed:
        raise SystemExit(f"only {len(plans)} batches planned, {needed} needed; lower --batches")
    return samples, [
        PlannedBatch(batch_id=i, epoch=0, sample_ids=ids) for i, ids in enumerate(plans[:needed])
    ]


def producer_flops(core: TargetCore, lengths: list[int]) -> float:
    """FLOPs of the layers the producer runs (0..max(layer_ids)) for samples of ``lengths``: every linear
    layer (2 per multiply-add) plus attention over each sample's causal triangle (QK^T and PV)."""
    text = core.config.get_text_config()
    h, inter = int(text.hidden_size), int(text.intermediate_size)
    heads, kv = int(text.num_attention_heads), int(text.num_key_value_heads)
    head_dim = int(getattr(text, "head_dim", None) or h // heads)
    layers = max(core.layer_ids) + 1
    linear = 2 * (h * head_dim * (2 * heads + 2 * kv) + 3 * h * inter) * sum(lengths)
    attention = sum(4 * heads * head_dim * n * (n + 1) // 2 for n in lengths)
    return float(layers * (linear + attention))


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def run_producer(
    core: TargetCore, samples: list[Sample], plans: list[PlannedBatch], keep: int
) -> tuple[float, list[torch.Tensor]]:
    """Seconds for ``plans`` through one TargetThread (as the producer runs it); features of the first
    ``keep`` batches are cloned before their slots are released."""
    plan_q: queue.Queue = queue.Queue()
    ready_q: queue.Queue = queue.Queue()
    for plan in plans:
        plan_q.put(plan)
    plan_q.put(None)
    thread = TargetThread(
        core, samples, plan_q, ready_q, RateMeter(), name=str(core.device), staging=PrivateStaging()
    )
    kept: dict[int, torch.Tensor] = {}
    t0 = time.perf_counter()
    thread.start()
    for _ in plans:
        item = ready_q.get()
        if isinstance(item, TargetFailure):
            raise item.error
        if item.plan.batch_id < plans[0].batch_id + keep:
            kept[item.plan.batch_id] = item.payload.tensors["features"].clone()
        item.slot.release()
    seconds = time.perf_counter() - t0
    thread.join()
    return seconds, [kept[k] for k in sorted(kept)]


@torch.inference_mode()
def plain_features(model: torch.nn.Module, layer_ids: tuple[int, ...], batch: list[Sample]) -> torch.Tensor:
    """What an offline dumper does: padded rows, the whole model, output_hidden_states, selected layers."""
    device = next(model.parameters()).device
    width = max(len(s.input_ids) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, s in enumerate(batch):
        ids[row, : len(s.input_ids)] = s.input_ids
        mask[row, : len(s.input_ids)] = 1
    ids, mask = ids.to(device), mask.to(device)
    hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
    return torch.cat([hs[i + 1] for i in layer_ids], dim=-1)[mask.bool()].cpu()  # [T, k*H]


def run_plain(
    core: TargetCore, samples: list[Sample], plans: list[PlannedBatch], keep: int
) -> tuple[float, int, list[torch.Tensor]]:
    """Seconds for ``plans`` through the plain forward, padded tokens computed, first ``keep`` features."""
    kept, padded = [], 0
    t0 = time.perf_counter()
    for k, plan in enumerate(plans):
        batch = [samples[i] for i in plan.sample_ids]
        feats = plain_features(core.model, core.layer_ids, batch)
        padded += len(batch) * max(len(s.input_ids) for s in batch)
        if k < keep:
            kept.append(feats)
    return time.perf_counter() - t0, padded, kept


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = qwen3_config(args.shape)
    layer_ids = default_target_layer_ids(config.num_hidden_layers, args.draft_layers)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    attention = None if args.attention == "auto" else args.attention
    compile_layers = {"auto": None, "on": True, "off": False}[args.compile_layers]
    core = TargetCore(config, layer_ids, device, dtype, attention=attention, compile_layers=compile_layers)
    build_s = time.perf_counter() - t0
    samples, plans = make_batches(args, config.vocab_size)
    warm, timed = plans[: args.warmup], plans[args.warmup :]
    tokens = sum(len(samples[i].input_ids) for p in timed for i in p.sample_ids)
    print(
        f"{args.shape} on {device} ({core.attention}), layers {list(layer_ids)}: {len(timed)} batches, {tokens} tokens"
    )

    t0 = time.perf_counter()
    run_producer(core, samples, warm, keep=0)
    warmup_s = time.perf_counter() - t0
    reset_peak(device)
    producer_s, producer_feats = run_producer(core, samples, timed, keep=COMPARED_BATCHES)
    producer_mem = peak_memory_gib(device)

    core.model.set_attn_implementation("sdpa")  # the plain forward is stock transformers
    run_plain(core, samples, warm[:1], keep=0)
    reset_peak(device)
    plain_s, padded_tokens, plain_feats = run_plain(core, samples, timed, keep=COMPARED_BATCHES)
    plain_mem = peak_memory_gib(device)

    diffs = [
        (a.float() - b.float()).abs().max().item() for a, b in zip(producer_feats, plain_feats, strict=True)
    ]
    ref_max = max(b.float().abs().max().item() for b in plain_feats)
    # bf16 through up to 34 layers: a few large absolute outliers are normal; the relative (Frobenius) error
    # says whether the features are the same.
    rel = [
        ((a.float() - b.float()).norm() / b.float().norm()).item()
        for a, b in zip(producer_feats, plain_feats, strict=True)
    ]
    lengths = [len(samples[i].input_ids) for p in timed for i in p.sample_ids]
    flops = producer_flops(core, lengths)
    rows = [
        {
            "path": "producer",
            "tokens_per_s": tokens / producer_s,
            "seconds": producer_s,
            "tokens_computed": tokens,
            "peak_memory_gib": producer_mem,
            "tflops_per_s": flops / producer_s / 1e12,
        },
        {
            "path": "plain_hf_padded",
            "tokens_per_s": tokens / plain_s,
            "seconds": plain_s,
            "tokens_computed": padded_tokens,
            "peak_memory_gib": plain_mem,
            "tflops_per_s": None,
        },
    ]
    summary = {
        "speedup": plain_s / producer_s,
        "goal_speedup": GOAL_SPEEDUP,
        "producer_mfu": flops / producer_s / (PEAK_TFLOPS * 1e12) if device.type == "cuda" else None,
        "goal_mfu": GOAL_MFU,
        "peak_tflops": PEAK_TFLOPS,
        "features_max_abs_diff": max(diffs),
        "features_ref_max_abs": ref_max,
        "features_rel_err": max(rel),
        "compared_batches": len(diffs),
        "padding_fraction_plain": 1 - tokens / padded_tokens,
        "build_s": build_s,
        "producer_warmup_s": warmup_s,
    }
    cfg = {
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "layer_ids": list(layer_ids),
        "attention_used": core.attention,
        "compile_layers_used": core.layers_compiled,
        "dtype": str(dtype).removeprefix("torch."),
        "timed_samples": len(lengths),
        "timed_tokens": tokens,
        "target_config": config.to_dict(),
    }
    result = BenchResult(name="producer_throughput", config=cfg, rows=rows, summary=summary)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "producer_throughput.json"
    report = {**dataclasses.asdict(result), "provenance": provenance()}
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    for row in rows:
        print(f"{row['path']:>16}: {row['tokens_per_s']:10.0f} tok/s  peak {row['peak_memory_gib']:.1f} GiB")
    mfu = summary["producer_mfu"]
    print(
        f"speedup {summary['speedup']:.2f}x (goal {GOAL_SPEEDUP}x), MFU "
        + (f"{mfu:.1%}" if mfu is not None else "n/a on CPU")
        + f", features max |diff| {summary['features_max_abs_diff']:.3g} (ref max {ref_max:.3g}), relative error {summary['features_rel_err']:.2e} -> {path}"
    )


if __name__ == "__main__":
    main()
