"""How evenly the planned batches load workers that train in lockstep (computed from the plan, no GPU).

Run:  PYTHONPATH=. python bench/batch_balance.py --data DATA.jsonl --token-budget 4096 --out DIR
Writes DIR/batch_balance.json and DIR/batch_balance.png.

Workers of a group step together, so each step lasts as long as its slowest batch. For k workers this takes
consecutive batches of the epoch's plan (``data.plan_batches``, as the producer plans them) k at a time and
reports mean cost / mean of the slowest cost, with a batch's cost taken two ways: its tokens, and the sum
of its samples' squared lengths (attention). 1.0 is perfect balance; it bounds drafter scaling from above.
The data is pre-tokenized JSONL with ``input_ids`` (``bench/make_data.py`` writes it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from rich.console import Console

from dflash_pipe.bench.result import BenchResult
from dflash_pipe.bench.save import save_result, show_result
from dflash_pipe.commands.options import add_field_arguments
from dflash_pipe.data import plan_batches


def lockstep_balance(costs: np.ndarray, workers: int) -> float:
    """Mean cost / mean of each step's largest cost, over the steps k consecutive batches make (a last,
    partial step is left out)."""
    steps = len(costs) // workers
    if steps == 0:
        raise ValueError(f"{len(costs)} batches cannot fill one step of {workers} workers")
    grouped = costs[: steps * workers].reshape(steps, workers)
    return float(grouped.mean() / grouped.max(axis=1).mean())


def balance_rows(lengths: np.ndarray, plan: list[list[int]], workers: list[int]) -> list[dict]:
    tokens = np.array([lengths[b].sum() for b in plan], dtype=np.float64)
    squares = np.array([(lengths[b].astype(np.float64) ** 2).sum() for b in plan])
    return [
        {
            "workers": k,
            "batches": len(plan),
            "mean_batch_tokens": round(float(tokens.mean()), 1),
            "lockstep_tokens": round(lockstep_balance(tokens, k), 3),
            "lockstep_squared_lengths": round(lockstep_balance(squares, k), 3),
        }
        for k in workers
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="pre-tokenized JSONL (input_ids per line)")
    add_field_arguments(p, "data.token_budget")
    p.add_argument("--workers", default="1,2,3,4", help="worker counts, e.g. 1,2,4")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    with args.data.open() as f:
        lengths = np.array([len(json.loads(line)["input_ids"]) for line in f if line.strip()])
    plan = plan_batches(lengths.tolist(), args.token_budget, seed=args.seed, epoch=0)
    rows = balance_rows(lengths, plan, [int(k) for k in args.workers.split(",")])
    tokens = [int(lengths[b].sum()) for b in plan]
    result = BenchResult(
        name="batch_balance",
        config={"data": str(args.data), "samples": len(lengths), "token_budget": args.token_budget},
        rows=rows,
        summary={
            "batch_tokens_min": min(tokens),
            "batch_tokens_max": max(tokens),
            "fill": round(float(np.mean(tokens)) / args.token_budget, 3),
        },
        chart={"x": "workers", "y": "lockstep_tokens", "kind": "line", "title": "lockstep balance"},
    )
    save_result(result, args.out)
    show_result(result, Console(stderr=True))


if __name__ == "__main__":
    main()
