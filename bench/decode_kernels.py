"""The kernels of a decode step, one at a time, against what each reads: the GEMMs of every projection
(cuBLAS as the compiled layers call it, cuBLAS on the transposed problem, cuBLASLt, and a Triton GEMM for
few rows, written here, over a sweep of tiles: each program owns ``BLOCK_N`` weight rows and every row of
``x``, so the weight is read once with no split-K reduction) and the decode-attention kernel over a
sweep of its launch settings (``target/decode/attention_kernel.py``).

Each case is timed as the engine runs it: ``--layers`` calls on distinct weights (or caches) captured in
one CUDA graph and replayed, so no launch cost is counted and nothing stays in L2 between calls. The rate
is bytes read (weights or live keys and values) per second; ``--bandwidth`` is the bound.

Run (H200):  PYTHONPATH=. python bench/decode_kernels.py --out DIR
Writes DIR/decode_kernels.json: every case, and per (shape, rows, projection) the fastest.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_target import SHAPES  # noqa: E402

from dflash_pipe.bench.save import provenance  # noqa: E402
from dflash_pipe.target.decode import attention_kernel  # noqa: E402


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """Tile sizes and launch settings of one kernel variant."""

    block_m: int = 64
    block_n: int = 32
    block_k: int = 128
    warps: int = 4
    stages: int = 4


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def skinny_gemm_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        row_ok = rm < M
        col_ok = rn < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, tl.cdiv(K, BLOCK_K)):
            ks = k0 * BLOCK_K + rk
            k_ok = ks < K
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
            )
            w = tl.load(
                w_ptr + rn[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0
            )
            acc += tl.dot(x, tl.trans(w))
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        y = acc.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=row_ok[:, None] & col_ok[None, :])

    return skinny_gemm_kernel


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemmConfig
) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias)`` as ``[M, N]`` in x's dtype."""
    import triton

    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m))
    _kernel()[grid](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.warps,
        num_stages=config.stages,
    )
    return y


def projections(shape: str) -> dict[str, tuple[int, int]]:
    """(out, in) features of the decode step's GEMMs (q/k/v and gate/up fused, as ``fuse.py`` does)."""
    hidden, _, heads, kv, head_dim, inter, vocab, _ = SHAPES[shape]
    return {
        "qkv": ((heads + 2 * kv) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (vocab, hidden),
    }


def graph_us(calls: list[Callable[[], object]], repeats: int = 20) -> float:
    """Microseconds per call of ``calls`` captured in one graph (after two eager warm-ups)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats / len(calls)


def gemm_cases(shape: str, rows: int, layers: int, configs: list[GemmConfig]) -> list[dict]:
    out: list[dict] = []
    for name, (n, k) in projections(shape).items():
        out += _projection_cases(shape, rows, name, n, k, 2 if name == "lm_head" else layers, configs)
        torch.cuda.empty_cache()
    return out


def _projection_cases(
    shape: str, rows: int, name: str, n: int, k: int, count: int, configs: list[GemmConfig]
) -> list[dict]:
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, weights[0]).float()
    out: list[dict] = []

    def case(path: str, fn: Callable[[torch.Tensor], torch.Tensor], **extra: object) -> None:
        err = (fn(weights[0]).float() - ref).abs().max().item()
        us = graph_us([functools_partial(fn, w) for w in weights])
        tb_s = round(n * k * 2 / us / 1e6, 2)
        out.append(
            dict(
                shape=shape,
                rows=rows,
                proj=name,
                n=n,
                k=k,
                path=path,
                us=round(us, 2),
                tb_s=tb_s,
                max_err=err,
                **extra,
            )
        )

    case("cublas", lambda w: F.linear(x, w))
    case("cublas_transposed", lambda w: torch.mm(w, x.t()).t())
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        case("cublaslt", lambda w: F.linear(x, w))
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")
    for cfg in configs:
        if cfg.block_m > max(rows, 64) or (rows >= 64 and cfg.block_m < 64):
            continue
        try:
            case("triton", lambda w, cfg=cfg: skinny_linear(x, w, None, cfg), config=repr(cfg))
        except Exception as exc:  # a tile that does not fit the SM's shared memory: skip it, say so
            print(f"  {shape} {name} rows {rows} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
    return out


def functools_partial(fn: Callable[[torch.Tensor], torch.Tensor], w: torch.Tensor) -> Callable[[], object]:
    return lambda: fn(w)


def attention_cases(shape: str, rows: int, span: int, layers: int) -> list[dict]:
    _, _, heads, kv, head_dim, _, _, _ = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(span // 3, span + 1, (rows,), generator=g).cuda()  # slots mid-reply
    caches = [
        (
            torch.randn(rows, kv, span + 1, head_dim, device="cuda", dtype=torch.bfloat16),
            torch.randn(rows, kv, span + 1, head_dim, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(layers)
    ]
    q = torch.randn(rows, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    new_k = torch.randn(rows, kv, head_dim, device="cuda", dtype=torch.bfloat16)
    new_v = torch.randn(rows, kv, head_dim, device="cuda", dtype=torch.bfloat16)
    positions = lengths - 1
    slot_of = torch.arange(rows, device="cuda")
    nbytes = int(lengths.sum()) * kv * head_dim * 2 * 2
    out = []
    for block, warps, stages, splits in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (1, 2, 4)):
        cfg = attention_kernel.KernelConfig(block=block, warps=warps, stages=stages, splits=splits)

        def call(keys: torch.Tensor, values: torch.Tensor, cfg=cfg) -> Callable[[], object]:
            def run() -> object:
                o, lse = attention_kernel.decode_attention(
                    q, keys, values, lengths, span, head_dim**-0.5, slot_of, (new_k, new_v, positions), cfg
                )
                return attention_kernel.combine(o, lse, heads // kv, torch.bfloat16)

            return run

        try:
            us = graph_us([call(k, v) for k, v in caches])
        except Exception as exc:
            print(f"  attention {shape} rows {rows} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        out.append(
            dict(
                shape=shape,
                rows=rows,
                span=span,
                config=repr(cfg),
                us=round(us, 2),
                tb_s=round(nbytes / us / 1e6, 2),
            )
        )
    del caches
    torch.cuda.empty_cache()
    return out


def best(cases: list[dict], keys: tuple[str, ...]) -> list[dict]:
    picked: dict[tuple, dict] = {}
    for c in cases:
        key = tuple(c[k] for k in keys) + (c.get("path", "attention"),)
        if key not in picked or c["us"] < picked[key]["us"]:
            picked[key] = c
    return sorted(picked.values(), key=lambda c: tuple(str(c[k]) for k in keys) + (c["us"],))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cases",
        default="qwen3-1.7b:64,qwen3-1.7b:256,qwen3-8b:64",
        help="SHAPE:ROWS pairs (rows: slots, the rows of each GEMM and the queries of attention)",
    )
    p.add_argument("--span", type=int, default=768)
    p.add_argument("--layers", type=int, default=8, help="distinct weights or caches per timed graph")
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    configs = [
        GemmConfig(bm, bn, bk, w, s)
        for bm, bn, bk, w, s in itertools.product(
            (16, 64, 128), (16, 32, 64, 128), (64, 128, 256), (4, 8), (3, 5)
        )
    ]
    gemms, attention = [], []
    for case in args.cases.split(","):
        shape, rows_text = case.split(":")
        rows = int(rows_text)
        if True:
            gemms += gemm_cases(shape, rows, args.layers, configs)
            for c in best([g for g in gemms if g["shape"] == shape and g["rows"] == rows], ("proj",)):
                print(
                    f"{shape} rows {rows} {c['proj']:8s} {c['path']:18s} {c['us']:8.2f} us "
                    f"{c['tb_s']:5.2f} TB/s {c.get('config', '')}",
                    flush=True,
                )
            if not args.skip_attention:
                attention += attention_cases(shape, rows, args.span, args.layers)
                ranked = sorted(
                    (a for a in attention if a["shape"] == shape and a["rows"] == rows), key=lambda a: a["us"]
                )
                default = [
                    a
                    for a in ranked
                    if a["config"]
                    == repr(
                        attention_kernel.KernelConfig(
                            splits=attention_kernel.splits_for(rows, SHAPES[shape][3], args.span)
                        )
                    )
                ]
                for a in ranked[:5] + default:
                    print(
                        f"{shape} rows {rows} attention {a['us']:8.2f} us {a['tb_s']:5.2f} TB/s {a['config']}",
                        flush=True,
                    )
    result = dict(
        name="decode_kernels",
        provenance=provenance(),
        config=vars(args) | {"out": str(args.out)},
        gemm_best=best(gemms, ("shape", "rows", "proj")),
        gemms=gemms,
        attention=attention,
    )
    (args.out / "decode_kernels.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
