"""Drafter training-step benchmark: fwd + bwd + AdamW at the Qwen3-8B drafter shape, flex vs SDPA.

Run: PYTHONPATH=. python bench/drafter_step.py --out DIR [--quick] [--backends flex,sdpa]
Weights are bf16 (on CUDA; fp32 on CPU); torch AdamW keeps its state in the parameter dtype (bf16), the
simplest setting. Writes DIR/drafter_step.json. Cold/warm first-step times run this script again in
subprocesses: cold on a fresh TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR, warm on that same dir.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEAK_TFLOPS = 790.0  # H200 dense bf16, the MFU reference of this repo


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output directory for drafter_step.json")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--context", type=int, default=3072, help="context tokens per sequence")
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--backends", default="flex,sdpa")
    p.add_argument("--quick", action="store_true", help="small shapes (CPU smoke test)")
    p.add_argument("--skip-cold", action="store_true", help="skip the cold/warm compile subprocesses")
    p.add_argument(
        "--compile-parts",
        default="attention",
        choices=["attention", "pointwise", "layers"],
        help="what torch.compile covers: attention only (train.compile=attention), + norms/MLP, whole layers and the "
        "CE terms (train.compile=full)",
    )
    p.add_argument(
        "--vary-shapes",
        type=int,
        default=0,
        help="then N steps at random context lengths and anchor counts: a recompile shows as a slow step",
    )
    p.add_argument("--profile", action="store_true", help="write a torch.profiler kernel table per backend")
    p.add_argument("--first-step-only", default=None, help=argparse.SUPPRESS)  # child mode: backend name
    return p.parse_args(argv)


def shapes(args: argparse.Namespace) -> dict:
    if args.quick:
        return dict(
            hidden=256,
            heads=4,
            kv_heads=2,
            head_dim=64,
            inter=512,
            vocab=1000,
            layers=min(args.layers, 2),
            context=min(args.context, 256),
            anchors=min(args.anchors, 16),
        )
    return dict(
        hidden=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        inter=12288,
        vocab=151936,
        layers=args.layers,
        context=args.context,
        anchors=args.anchors,
    )


def build(sh: dict, args: argparse.Namespace, backend: str, device, dtype, seed: int = 0):
    import torch
    from torch import nn

    from dflash_pipe.drafter import DFlashDrafter, DrafterConfig
    from dflash_pipe.train.build import apply_compile

    cfg = DrafterConfig(
        hidden_size=sh["hidden"],
        intermediate_size=sh["inter"],
        num_attention_heads=sh["heads"],
        num_key_value_heads=sh["kv_heads"],
        head_dim=sh["head_dim"],
        num_hidden_layers=sh["layers"],
        vocab_size=sh["vocab"],
        block_size=args.block_size,
        mask_token_id=sh["vocab"] - 1,
        target_layer_ids=tuple(range(1, 6)),
        num_target_layers=8,
        max_anchors=sh["anchors"],
        attention_backend=backend,
    )
    torch.manual_seed(seed)
    embed = nn.Embedding(sh["vocab"], sh["hidden"], device=device, dtype=dtype)
    head = nn.Linear(sh["hidden"], sh["vocab"], bias=False, device=device, dtype=dtype)
    nn.init.normal_(head.weight, std=0.02)
    full = args.compile_parts == "layers"  # what train.compile=full runs
    model = DFlashDrafter(cfg, embed, head).to(device=device, dtype=dtype)
    apply_compile(model, attention=device.type == "cuda", layers=full, fused_ce=full)
    compile_parts(model, args.compile_parts)
    g = torch.Generator().manual_seed(seed)
    b, s = args.batch, sh["context"]
    ids = torch.randint(0, sh["vocab"] - 1, (b, s), generator=g).to(device)
    feats = (torch.randn(b, s, cfg.feature_size, generator=g) * 0.5).to(device=device, dtype=dtype)
    loss_mask = torch.ones(b, s, dtype=torch.bool, device=device)
    return model, (ids, feats, loss_mask)


def compile_parts(model, parts: str) -> None:
    """Experiment: let Inductor fuse more than attention (module.compile is in place, public API)."""
    if parts != "pointwise":
        return  # "layers": compiled by train.build.apply_compile in build()
    for layer in model.layers:
        for mod in (layer.mlp, layer.input_layernorm, layer.post_attention_layernorm):
            mod.compile(dynamic=True)
        layer.self_attn.q_norm.compile(dynamic=True)
        layer.self_attn.k_norm.compile(dynamic=True)
    model.norm.compile(dynamic=True)
    model.hidden_norm.compile(dynamic=True)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step(model, opt, inputs, seed: int):
    import torch

    gen = torch.Generator(device=inputs[0].device).manual_seed(seed)
    out = model(*inputs, generator=gen)
    out.loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def count_flops(model, inputs) -> dict:
    """Model FLOPs of one training step, counted by hand.

    The drafter layers count x3 (forward, input grad, weight grad). The frozen LM head and the fc layer
    count x2: the head needs no weight grad, and the fc's input (the target features) needs no grad.
    """
    import torch

    from dflash_pipe.drafter.masks import dense_mask, sample_anchors, training_eligible

    cfg = model.cfg
    ids, _, loss_mask = inputs
    gen = torch.Generator(device=ids.device).manual_seed(0)
    anchors, valid = sample_anchors(training_eligible(loss_mask), cfg.max_anchors, generator=gen)
    b, s = ids.shape
    q = anchors.shape[1] * cfg.block_size  # query rows per sequence
    k = s + q
    visible = int(dense_mask(anchors, valid, s, cfg.block_size).sum())  # (query, key) pairs, all sequences
    windows = getattr(cfg, "layer_windows", (None,) * cfg.num_hidden_layers)  # a sliding layer sees less
    seen = {
        w: visible if w is None else int(dense_mask(anchors, valid, s, cfg.block_size, w).sum())
        for w in set(windows)
    }
    h, d, hq, hkv, inter = (
        cfg.hidden_size,
        cfg.head_dim,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
    )
    per_layer_proj = 2 * b * (q * h * hq * d + 2 * k * h * hkv * d + q * hq * d * h)
    attention = sum(2 * 2 * hq * d * seen[w] for w in windows)  # QK^T and PV over visible pairs only
    per_layer_mlp = 2 * b * q * 3 * h * inter
    fc = 2 * b * s * cfg.feature_size * h
    scored = int(valid.sum()) * (cfg.block_size - 1)  # upper bound: every slot in range and loss-masked
    lm_head = 2 * scored * h * cfg.vocab_size
    layers = cfg.num_hidden_layers * (per_layer_proj + per_layer_mlp) + attention
    fwd = layers + fc + lm_head
    return {
        "forward": fwd,
        "train_step": 3 * layers + 2 * fc + 2 * lm_head,
        "attention_pairs_visible": visible,
        "mask_density": visible / (b * q * k),
        "lm_head_forward": lm_head,
        "scored_rows": scored,
    }


def first_step(args: argparse.Namespace) -> None:
    """Child mode: time the very first training step (includes compilation) and print JSON."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, inputs = build(shapes(args), args, args.first_step_only, device, dtype)
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=1e-4, fused=device.type == "cuda" or None)
    sync(device)
    t0 = time.perf_counter()
    step(model, opt, inputs, seed=0)
    sync(device)
    print(json.dumps({"first_step_s": time.perf_counter() - t0}))


def cold_warm(args: argparse.Namespace, backend: str) -> dict:
    cache = tempfile.mkdtemp(prefix="dflash-bench-inductor-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--out",
        str(args.out),
        "--first-step-only",
        backend,
        "--layers",
        str(args.layers),
        "--context",
        str(args.context),
        "--anchors",
        str(args.anchors),
        "--batch",
        str(args.batch),
        "--block-size",
        str(args.block_size),
        "--compile-parts",
        args.compile_parts,
    ] + (["--quick"] if args.quick else [])
    result = {"cache_dir": cache}
    for label in ("cold", "warm"):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            result[label] = {"error": proc.stderr[-2000:]}
            continue
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
        result[label] = {**json.loads(line), "process_wall_s": wall}
    return result


def measure(args, sh, backend, device, dtype) -> dict:
    import torch

    model, inputs = build(sh, args, backend, device, dtype)
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=1e-4, fused=device.type == "cuda" or None)
    flops = count_flops(model, inputs)
    for i in range(args.warmup):
        step(model, opt, inputs, seed=i)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        step(model, opt, inputs, seed=100 + i)
        sync(device)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    res = {
        "step_s_median": med,
        "step_s_all": times,
        "tokens_per_s": args.batch * sh["context"] / med,
        "tflops_per_s": flops["train_step"] / med / 1e12,
        "flops": flops,
    }
    if device.type == "cuda":
        res["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        res["mfu"] = res["tflops_per_s"] / PEAK_TFLOPS
    if args.vary_shapes:
        res["varying_shapes"] = vary_shapes(model, opt, sh, args, device, dtype)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(model, opt, inputs, seed=999)
            sync(device)
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"profile_{backend}_{args.compile_parts}.txt").write_text(table)
    return res


def vary_shapes(model, opt, sh, args, device, dtype) -> list[dict]:
    """Training on ever-new (context, anchor count) shapes must not recompile each step."""
    import torch

    g = torch.Generator().manual_seed(5)
    rows = []
    for i in range(args.vary_shapes):
        s = int(torch.randint(256, sh["context"] + 1, (1,), generator=g))
        model.cfg.max_anchors = int(torch.randint(16, sh["anchors"] + 1, (1,), generator=g))
        ids = torch.randint(0, sh["vocab"] - 1, (args.batch, s), generator=g).to(device)
        feats = torch.randn(args.batch, s, model.cfg.feature_size, generator=g).to(device=device, dtype=dtype)
        mask = torch.ones(args.batch, s, dtype=torch.bool, device=device)
        sync(device)
        t0 = time.perf_counter()
        step(model, opt, (ids, feats, mask), seed=200 + i)
        sync(device)
        rows.append({"context": s, "anchors": model.cfg.max_anchors, "step_s": time.perf_counter() - t0})
        print(f"  shape {s} x {model.cfg.max_anchors}: {rows[-1]['step_s'] * 1e3:.0f} ms", file=sys.stderr)
    model.cfg.max_anchors = sh["anchors"]
    return rows


def equality(args, sh, backends, device, dtype) -> dict:
    """Same weights, inputs and anchors through both backends: max |diff| of loss and of every grad."""

    outs = {}
    for backend in backends:
        model, inputs = build(sh, args, backend, device, dtype, seed=1)
        out = step(model, None, inputs, seed=7)
        outs[backend] = (out.loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()})
        del model
    (la, ga), (lb, gb) = outs[backends[0]], outs[backends[1]]
    diffs = {n: float((ga[n] - gb[n]).abs().max()) for n in ga}
    worst = max(diffs, key=diffs.get)
    return {
        "loss": {b: float(outs[b][0]) for b in backends},
        "loss_abs_diff": float((la - lb).abs()),
        "grad_max_abs_diff": diffs[worst],
        "grad_worst_param": worst,
        "grad_max_abs": max(float(g.abs().max()) for g in ga.values()),
    }


def main(argv: list[str] | None = None) -> None:
    from dflash_pipe.bench.save import provenance

    args = parse_args(argv)
    if args.first_step_only:
        first_step(args)
        return
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if device.type == "cpu" and "flex" in backends:
        print("flex_attention has no CPU backward: dropping flex on CPU", file=sys.stderr)
        backends = [b for b in backends if b != "flex"]
    sh = shapes(args)
    report = {
        "provenance": provenance(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "shapes": sh,
        "dtype": str(dtype),
        "optimizer": "torch AdamW (fused on CUDA), state in param dtype",
        "device": str(device),
        "results": {},
    }
    for backend in backends:
        print(f"[{backend}] measuring ...", file=sys.stderr)
        report["results"][backend] = measure(args, sh, backend, device, dtype)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if backend == "flex" and not args.skip_cold:
            report["results"][backend]["first_step"] = cold_warm(args, backend)
    if len(backends) >= 2:
        report["equality"] = equality(args, sh, backends[:2], device, dtype)
    if {"flex", "sdpa"} <= set(report["results"]):
        r = report["results"]
        report["flex_speedup_vs_sdpa"] = r["sdpa"]["step_s_median"] / r["flex"]["step_s_median"]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "drafter_step.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    for backend, res in report["results"].items():
        extra = f", peak {res['peak_mem_gib']:.2f} GiB, MFU {res['mfu']:.1%}" if "mfu" in res else ""
        print(f"{backend}: {res['step_s_median'] * 1e3:.1f} ms/step, {res['tokens_per_s']:.0f} tok/s{extra}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
