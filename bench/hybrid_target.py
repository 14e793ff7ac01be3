"""Hybrid target producer bench: the Qwen3.5 hybrid (first 16 layers of the 27B shape) through TargetCore on
16K-token packed batches, packed with flash-linear-attention vs padded vs the torch fallback vs a dense Qwen3
of the same width; tokens/s, MFU over the linear layers, memory after each batch, and features checked
against each sample alone through the plain HF model (``dflash_pipe.bench.hybrid`` has the logic).

Run (H200, ~6 min; fla installed): PYTHONPATH=. python bench/hybrid_target.py --out DIR
CPU synthetic mode (seconds):      PYTHONPATH=. python bench/hybrid_target.py --out DIR --shape tiny \\
                                     --device cpu --batches 2 --warmup 1 --token-budget 512 --max-len 128
Writes DIR/hybrid_target.json (rows, per-path details, goal check, provenance).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from dflash_pipe.bench.hybrid import PATHS, SHAPES, bench_hybrid
from dflash_pipe.bench.save import save_result, show_result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for hybrid_target.json")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.5-27b-16l")
    p.add_argument("--device", default="cuda")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {','.join(PATHS)}")
    p.add_argument(
        "--batches", type=int, default=8, help="timed batches per path (torch fallback: a quarter)"
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed batches first (compile, autotune)")
    p.add_argument("--token-budget", type=int, default=16384, help="tokens per packed batch")
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=3072)
    p.add_argument("--child-timeout", type=float, default=300.0, help="seconds per path")
    args = p.parse_args(argv)
    paths = [x for x in args.paths.split(",") if x]
    bad = sorted(set(paths) - set(PATHS))
    if bad:
        p.error(f"--paths: unknown {bad}; pick from {list(PATHS)}")
    sizes = ("shape", "device", "batches", "warmup", "token_budget", "min_len", "max_len")
    result = bench_hybrid(
        **{k: getattr(args, k) for k in sizes},
        paths=paths,
        child_timeout_s=args.child_timeout,
        on_path=lambda partial: save_result(partial, args.out),
    )
    files = save_result(result, args.out)
    show_result(result, Console(width=200))
    print(f"-> {files['json']}")


if __name__ == "__main__":
    main()
