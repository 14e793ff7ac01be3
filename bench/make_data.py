"""Synthetic pre-tokenized JSONL with mixed lengths, for throughput runs (token ids, not text).

Run: python bench/make_data.py --out /tmp/mixed.jsonl --samples 2000 --min-len 128 --max-len 3072
Each sample: random ids in [4, vocab), the first ~20% as prompt (loss_mask 0), the rest as answer.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=3072)
    p.add_argument(
        "--vocab", type=int, default=1000, help="ids drawn below this (the demo tokenizer has 1035)"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w") as f:
        for _ in range(args.samples):
            n = rng.randint(args.min_len, args.max_len)
            prompt = max(1, n // 5)
            ids = [rng.randrange(4, args.vocab) for _ in range(n)]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (n - prompt)}) + "\n")
    print(f"wrote {args.samples} samples of {args.min_len}-{args.max_len} tokens to {args.out}")


if __name__ == "__main__":
    main()
