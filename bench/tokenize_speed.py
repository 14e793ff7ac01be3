"""Tokenization of a conversation JSONL: in-process against the worker pool (``data.tokenize_workers``).

Run:  PYTHONPATH=. python bench/tokenize_speed.py --out DIR [--size-mb 16] [--workers 2,4,8]
Writes DIR/tokenize_speed.json (provenance, one row per mode) and DIR/tokenize_speed.png.

The data is generated: multi-turn conversations of random words drawn from the bundled demo data's
vocabulary, rendered with the bundled demo tokenizer's chat template (or ``--tokenizer DIR``, a local HF
tokenizer with a chat template; nothing is downloaded). Each mode loads the whole file with
``load_samples`` (so a pool's time includes starting its processes) and must give exactly the in-process
samples; a difference is an error, not a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from dflash_pipe.bench.result import BenchResult
from dflash_pipe.bench.save import save_result, show_result
from dflash_pipe.data import DataConfig, LoadedData, demo_data_path, demo_tokenizer, load_samples
from dflash_pipe.data import loader as data_loader


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--size-mb", type=float, default=16.0, help="size of the generated JSONL (MB)")
    p.add_argument(
        "--workers", default=None, help="comma-separated pool sizes (default: 2 and the automatic count)"
    )
    p.add_argument(
        "--tokenizer", type=Path, help="local HF tokenizer dir with a chat template (default: demo)"
    )
    p.add_argument("--max-length", type=int, default=3072)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def write_conversations(path: Path, size_bytes: int, seed: int) -> int:
    """Random multi-turn conversations (1-4 turns, 5-120 words a message) until the file has
    ``size_bytes``; returns the number of lines."""
    words = sorted(set(re.findall(r"[a-z]+", demo_data_path().read_text().lower())))
    rng = random.Random(seed)
    lines = written = 0
    with open(path, "w") as f:
        while written < size_bytes:
            messages = []
            for _ in range(rng.randint(1, 4)):
                for role in ("user", "assistant"):
                    text = " ".join(rng.choices(words, k=rng.randint(5, 120)))
                    messages.append({"role": role, "content": text.capitalize() + "."})
            line = json.dumps({"messages": messages}) + "\n"
            f.write(line)
            written += len(line)
            lines += 1
    return lines


def timed_load(path: Path, tokenizer, workers: int, max_length: int) -> tuple[LoadedData, float, float]:
    """The load, its wall seconds and the CPU seconds it took (this process and its ended workers)."""
    cfg = DataConfig(path=path, max_length=max_length, tokenize_workers=workers)
    cpu0, start = _cpu_seconds(), time.perf_counter()
    data = load_samples(cfg, tokenizer, progress=False)
    return data, time.perf_counter() - start, _cpu_seconds() - cpu0


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def check_same(a: LoadedData, b: LoadedData, what: str) -> None:
    same = (
        len(a.samples) == len(b.samples)
        and all(
            x.input_ids.equal(y.input_ids) and x.loss_mask.equal(y.loss_mask)
            for x, y in zip(a.samples, b.samples, strict=True)
        )
        and (a.truncated, a.dropped_short, a.skip_reasons) == (b.truncated, b.dropped_short, b.skip_reasons)
    )
    if not same:
        raise SystemExit(f"tokenize_speed: {what} gave other samples than the in-process load")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    auto = data_loader.auto_workers()
    pools = [int(w) for w in args.workers.split(",")] if args.workers else sorted({2, max(2, auto)})
    if any(w < 2 for w in pools):
        raise SystemExit("--workers: pool sizes must be >= 2 (1 is the in-process row, always measured)")
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer), local_files_only=True)
    else:
        tokenizer = demo_tokenizer()
    size = int(args.size_mb * 1e6)
    if size < data_loader.POOL_MIN_BYTES:
        raise SystemExit(
            f"--size-mb {args.size_mb}: files under {data_loader.POOL_MIN_BYTES / 1e6:.1f} MB are always "
            "tokenized in-process; give a bigger size"
        )
    load_before = os.getloadavg()[0]  # other processes on the machine take cores from the pool
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "conversations.jsonl"
        lines = write_conversations(path, size, args.seed)
        nbytes = path.stat().st_size
        serial, serial_s, cpu_s = timed_load(path, tokenizer, 1, args.max_length)
        rows = [_row("in-process", 1, serial, serial_s, cpu_s, nbytes, serial_s)]
        for workers in pools:
            pooled, pooled_s, cpu_s = timed_load(path, tokenizer, workers, args.max_length)
            check_same(serial, pooled, f"a pool of {workers}")
            rows.append(_row(f"pool of {workers}", workers, pooled, pooled_s, cpu_s, nbytes, serial_s))
    best = max(rows[1:], key=lambda r: r["speedup"])
    result = BenchResult(
        name="tokenize_speed",
        config={
            "size_bytes": nbytes,
            "lines": lines,
            "tokenizer": str(args.tokenizer) if args.tokenizer else "bundled demo tokenizer",
            "max_length": args.max_length,
            "cpus": os.cpu_count(),
            "load_average_1min_before": load_before,
            "auto_workers": auto,
            "seed": args.seed,
        },
        rows=rows,
        summary={
            "samples": len(serial.samples),
            "tokens": serial.num_tokens,
            "best_pool": best["mode"],
            "best_speedup": best["speedup"],
            "notes": [
                "each pool time includes starting its worker processes (spawn, tokenizer pickled once)"
            ],
        },
        chart={"x": "mode", "y": "mb_per_s", "title": f"tokenizing {nbytes / 1e6:.0f} MB of conversations"},
    )
    save_result(result, args.out)
    show_result(result, Console(stderr=True))


def _row(
    mode: str, workers: int, data: LoadedData, seconds: float, cpu_s: float, nbytes: int, serial_s: float
) -> dict:
    return {
        "mode": mode,
        "workers": workers,
        "seconds": seconds,
        "cpu_seconds": cpu_s,
        "mb_per_s": nbytes / 1e6 / seconds,
        "samples_per_s": len(data.samples) / seconds,
        "tokens_per_s": data.num_tokens / seconds,
        "speedup": serial_s / seconds,
    }


if __name__ == "__main__":
    sys.exit(main())
