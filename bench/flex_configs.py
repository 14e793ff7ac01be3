"""The drafter's flex_attention forward + backward at one shape, per Triton tile config (issue 20).

At the Qwen3.6-27B drafter shape (24 x 256 query heads, 4 KV heads) the profile of the compiled step showed
flex_attention's backward at six times its forward (a fifth of the step): Inductor's default backward
tiles for head_dim > 128 on sm90 are 64 x 64 with 4 warps, too few warps for head_dim 256. This times the
drafter's own attention (its block masks from ``drafter.masks``, full and sliding, anchors drawn as
training draws them) per candidate ``kernel_options``, checks each against the default config's output and
gradients, and names the fastest. ``--autotune`` also runs Inductor's own max-autotune search over its
config list (slow: it compiles every candidate).

  PYTHONPATH=. python bench/flex_configs.py --out DIR                     # Qwen3.6-27B drafter shape, H200
  PYTHONPATH=. python bench/flex_configs.py --head-dim 128 --heads 32 --kv-heads 8 --out DIR
Writes DIR/flex_configs.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from dflash_pipe.compute.compile import apply_dynamo_settings
from dflash_pipe.drafter.masks import (
    anchor_pad_multiple,
    flex_block_mask,
    pad_anchors,
    sample_anchors,
    training_eligible,
)

BWD_TILES = [(64, 64, 8, 2), (32, 64, 4, 3), (32, 64, 8, 2), (32, 32, 4, 3), (64, 128, 8, 2)]
"""(BLOCK_M1, BLOCK_N1, num_warps, num_stages) of the backward: dK/dV over N1-key tiles, dQ over M1 rows
(BLOCK_M2 = N1, BLOCK_N2 = M1, the pattern Inductor's own configs use)."""
FWD_TILES = [(128, 64, 8, 2), (64, 32, 4, 3)]
"""(BLOCK_M, BLOCK_N, num_warps, num_stages) of the forward."""


def kernel_options(fwd: tuple | None, bwd: tuple | None) -> dict[str, int]:
    out: dict[str, int] = {}
    if fwd:
        m, n, warps, stages = fwd
        out |= {"fwd_BLOCK_M": m, "fwd_BLOCK_N": n, "fwd_num_warps": warps, "fwd_num_stages": stages}
    if bwd:
        m1, n1, warps, stages = bwd
        out |= {"bwd_BLOCK_M1": m1, "bwd_BLOCK_N1": n1, "bwd_BLOCK_M2": n1, "bwd_BLOCK_N2": m1}
        out |= {"bwd_num_warps": warps, "bwd_num_stages": stages}
    return out


def prefixed_options_supported() -> bool:
    """Whether this torch reads ``fwd_``/``bwd_`` prefixed kernel options (else both passes share them)."""
    import inspect

    from torch._inductor.kernel.flex import flex_attention as lowering

    return 'startswith("bwd_")' in inspect.getsource(lowering)


def inputs(args: argparse.Namespace, device: torch.device):
    """q [B, Hq, N*bs, D], k/v [B, Hkv, S+N*bs, D] and the drafter's masks (full, sliding) for one batch."""
    gen = torch.Generator(device=device).manual_seed(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    b, s = len(lengths), -(-max(lengths) // 128) * 128
    loss_mask = torch.zeros(b, s, dtype=torch.bool, device=device)
    for row, length in enumerate(lengths):
        loss_mask[row, length // 3 : length] = True
    anchors, valid = sample_anchors(training_eligible(loss_mask), args.max_anchors, generator=gen)
    anchors, valid = pad_anchors(anchors, valid, anchor_pad_multiple(args.block_size))
    q_len = anchors.shape[1] * args.block_size
    masks = {
        name: flex_block_mask(anchors, valid, s, args.block_size, compile=True, window=window)
        for name, window in (("full", None), ("sliding", args.window))
    }

    def rand(heads: int, length: int) -> torch.Tensor:
        t = torch.randn(b, heads, length, args.head_dim, device=device, dtype=torch.bfloat16, generator=gen)
        return t.requires_grad_()

    return rand(args.heads, q_len), rand(args.kv_heads, s + q_len), rand(args.kv_heads, s + q_len), masks


def run_config(fn, q, k, v, mask, options: dict, iters: int) -> tuple[float, float, list[torch.Tensor]]:
    """(forward ms, forward + backward ms) medians, and the output and gradients of the last pass."""
    grad_out = torch.ones_like(q) / q.shape[-1]

    def once(backward: bool):
        q.grad = k.grad = v.grad = None
        out = fn(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options or None)
        if backward:
            out.backward(grad_out)
        return out

    times: dict[bool, list[float]] = {False: [], True: []}
    for backward in (False, True):
        for i in range(iters + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = once(backward)
            torch.cuda.synchronize()
            if i:  # the first pass compiles
                times[backward].append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[False]), statistics.median(times[True]), [out, q.grad, k.grad, v.grad]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--lengths", default="2292,2244,2240", help="the batch's sample lengths (a planned batch)")
    p.add_argument("--max-anchors", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--window", type=int, default=2048, help="the sliding layers' window")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--autotune", action="store_true", help="also Inductor's max-autotune search")
    args = p.parse_args(argv)
    from torch.nn.attention.flex_attention import flex_attention

    apply_dynamo_settings()  # one graph per config: the default recompile limit would fall back to eager
    device = torch.device("cuda")
    print("torch", torch.__version__, "fwd_/bwd_ options:", prefixed_options_supported(), flush=True)
    q, k, v, masks = inputs(args, device)
    candidates: list[tuple[str, dict]] = [("default", {})]
    candidates += [(f"bwd {t}", kernel_options(None, t)) for t in BWD_TILES]
    candidates += [(f"fwd {t}", kernel_options(t, None)) for t in FWD_TILES]
    fn = torch.compile(flex_attention, dynamic=True)
    rows, reference = [], {}
    for name, options in candidates:
        for mask_name, mask in masks.items():
            row: dict[str, Any] = {"config": name, "mask": mask_name, "options": options}
            try:
                fwd_ms, step_ms, tensors = run_config(fn, q, k, v, mask, options, args.iters)
            except Exception as exc:  # a config Triton cannot build (registers, shared memory) is a row
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                rows.append(row)
                print(name, mask_name, row["error"], flush=True)
                continue
            ref = reference.setdefault(mask_name, [t.detach().float() for t in tensors])
            row["max_rel"] = max(
                float((t.float() - r).norm() / r.norm().clamp_min(1e-30))
                for t, r in zip(tensors, ref, strict=True)
            )
            row.update(
                fwd_ms=round(fwd_ms, 3), fwd_bwd_ms=round(step_ms, 3), bwd_ms=round(step_ms - fwd_ms, 3)
            )
            rows.append(row)
            print(
                f"{name:24s} {mask_name:8s} fwd {fwd_ms:7.2f} ms  bwd {step_ms - fwd_ms:7.2f} ms  rel {row['max_rel']:.1e}",
                flush=True,
            )
    if args.autotune:
        import torch._inductor.config as inductor_config

        torch._dynamo.reset()
        inductor_config.max_autotune = True
        tuned = torch.compile(flex_attention, dynamic=True)
        for mask_name, mask in masks.items():
            fwd_ms, step_ms, _ = run_config(tuned, q, k, v, mask, {}, args.iters)
            rows.append(
                {"config": "max-autotune", "mask": mask_name, "fwd_ms": fwd_ms, "bwd_ms": step_ms - fwd_ms}
            )
            print(f"max-autotune {mask_name}: fwd {fwd_ms:.2f} ms bwd {step_ms - fwd_ms:.2f} ms", flush=True)
    ok = [r for r in rows if "error" not in r and r["config"] != "max-autotune" and r["max_rel"] < 2e-2]
    best = {m: min((r for r in ok if r["mask"] == m), key=lambda r: r["fwd_bwd_ms"])["config"] for m in masks}
    result = {
        "config": vars(args) | {"out": str(args.out)},
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "rows": rows,
        "best": best,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flex_configs.json").write_text(json.dumps(result, indent=1))
    print("best:", best)
    return result


if __name__ == "__main__":
    main()
