"""Peak memory and time to the first batch: the same conversations as parquet against JSONL.

Run:  PYTHONPATH=. python bench/data_sources.py --out DIR [--conversations 1000000]
Writes DIR/data_sources.json (provenance, one row per case) and DIR/data_sources.png.

The data is generated in a temp dir: single-turn conversations of random words from the bundled demo
data's vocabulary (3-30 words a message), written once as JSONL and once as parquet (row groups of
``--row-group`` rows), streamed to disk so generation holds no whole dataset. Each case runs in a fresh
process (so its peak RSS is its own):

- ``jsonl`` / ``parquet``: ``load_samples`` with the bundled demo tokenizer into an on-disk sample store
  (``data/store.py``, as a run does in ``RUN_DIR/samples``), then ``plan_batches`` and the first batch's
  samples: the time a run waits before its first batch, and the process's peak RSS. The two must give the
  same samples (checked by a digest of the stores' files), or the bench fails.
- ``jsonl, store reused`` / ``parquet, store reused``: the same in a new process over the store the case
  before built (a resumed run): nothing is tokenized (checked: the store is not rewritten).
- ``jsonl in memory`` / ``parquet in memory`` (only with ``--in-memory``): ``load_samples`` without a
  store, every sample a pair of tensors in memory (the code before the store).
- ``parquet read only`` / ``jsonl read only``: every row read and decoded (parquet: record batches to
  dicts; JSONL: ``json.loads`` per line), nothing kept: what the reader alone holds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from dflash_pipe.bench.result import BenchResult
from dflash_pipe.bench.save import save_result, show_result
from dflash_pipe.commands.options import add_field_arguments

CASES = (
    "jsonl",
    "jsonl, store reused",
    "parquet",
    "parquet, store reused",
    "jsonl read only",
    "parquet read only",
)
IN_MEMORY = ("jsonl in memory", "parquet in memory")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="output directory (required unless --measure)")
    p.add_argument("--conversations", type=int, default=1_000_000)
    p.add_argument("--row-group", type=int, default=10_000, help="parquet rows per row group")
    add_field_arguments(p, "data.token_budget", "data.tokenize_workers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--in-memory", action="store_true", help="also the in-memory load (no store), for comparison"
    )
    p.add_argument("--measure", nargs=2, metavar=("CASE", "PATH"), help=argparse.SUPPRESS)  # child process
    return p.parse_args(argv)


def conversations(n: int, seed: int):
    """``n`` single-turn conversations of random demo-vocabulary words."""
    from dflash_pipe.data import demo_data_path

    words = sorted(set(re.findall(r"[a-z]+", demo_data_path().read_text().lower())))
    rng = random.Random(seed)
    for _ in range(n):
        q, a = (" ".join(rng.choices(words, k=rng.randint(3, 30))).capitalize() + "." for _ in range(2))
        yield {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def write_data(tmp: Path, n: int, seed: int, row_group: int) -> tuple[Path, Path]:
    """The same conversations as ``data.jsonl`` and ``data.parquet``, written as they are made."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl, parquet = tmp / "data.jsonl", tmp / "data.parquet"
    chunk: list[dict] = []
    with open(jsonl, "w") as f, pq.ParquetWriter(parquet, _schema(pa)) as writer:
        for conv in conversations(n, seed):
            f.write(json.dumps(conv) + "\n")
            chunk.append(conv)
            if len(chunk) == row_group:
                writer.write_table(pa.Table.from_pylist(chunk, schema=_schema(pa)))
                chunk = []
        if chunk:
            writer.write_table(pa.Table.from_pylist(chunk, schema=_schema(pa)))
    return jsonl, parquet


def _schema(pa):
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema([("messages", pa.list_(message))])


def measure(case: str, path: Path, args: argparse.Namespace) -> dict:
    """One case in this (fresh) process: seconds and peak RSS, after the imports a run has anyway."""
    from dflash_pipe.data import DataConfig, demo_tokenizer, load_samples, plan_batches, sample_lengths
    from dflash_pipe.data.store import META

    tokenizer = demo_tokenizer()
    row: dict = {"case": case, "rss_imports_mib": _peak_rss_mib()}
    if case.startswith("parquet"):  # the data extra's imports (datasets, pyarrow, pandas): a fixed cost
        from dflash_pipe.data.hub import require_datasets

        require_datasets(str(path))
    store = None if case.endswith(("in memory", "read only")) else store_dir(path)
    built = (store / META).stat().st_mtime_ns if store is not None and case.endswith("reused") else None
    base_mib = _peak_rss_mib()
    start = time.perf_counter()
    if case.endswith("read only"):
        row["rows"] = _read_only(case, path)
    else:
        cfg = DataConfig(path=path, token_budget=args.token_budget, tokenize_workers=args.tokenize_workers)
        data = load_samples(cfg, tokenizer, progress=False, store=store)
        loaded = time.perf_counter() - start
        first = plan_batches(sample_lengths(data.samples), cfg.token_budget, seed=0, epoch=0)[0]
        batch = [data.samples[i] for i in first]
        row.update(
            rows=len(data.samples), tokens=data.num_tokens, load_s=loaded, first_batch_samples=len(batch)
        )
    row["seconds"] = time.perf_counter() - start
    row["peak_rss_mib"] = _peak_rss_mib()
    if built is not None and (store / META).stat().st_mtime_ns != built:
        raise SystemExit(f"data_sources: case {case!r} rebuilt the store instead of reusing it")
    if not case.endswith("read only"):  # after the clock: not part of the time to the first batch
        row["digest"] = _digest(data)
        row["store_mib"] = _store_mib(store)
    row["rss_before_mib"] = base_mib
    row["rss_growth_mib"] = row["peak_rss_mib"] - base_mib
    row["rss_extra_imports_mib"] = base_mib - row.pop("rss_imports_mib")
    return row


def _read_only(case: str, path: Path) -> int:
    n = 0
    if case.startswith("jsonl"):
        with open(path, "rb") as f:
            for line in f:
                json.loads(line)
                n += 1
        return n
    from dflash_pipe.data.sources import resolve_source
    from dflash_pipe.data.tables import table_rows

    return sum(1 for _ in table_rows(resolve_source(path)))


def store_dir(path: Path) -> Path:
    """The store of one data file's cases (built by the first, reused by the second)."""
    return path.with_name(path.stem + "-samples")


def _digest(data) -> str:
    """The samples' token ids, masks and lengths, the same for a store and a list of tensors."""
    import numpy as np

    from dflash_pipe.data import sample_lengths

    h = hashlib.sha256(sample_lengths(data.samples).tobytes())
    for s in data.samples:
        h.update(s.input_ids.numpy().astype(np.int64).tobytes())
        h.update(np.packbits(s.loss_mask.numpy()).tobytes())
    return h.hexdigest()


def _store_mib(store: Path | None) -> float | None:
    return None if store is None else sum(f.stat().st_size for f in store.iterdir()) / 2**20


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_case(case: str, path: Path, argv: list[str]) -> dict:
    """``measure`` in a fresh interpreter; its row comes back as the last line of its stdout."""
    cmd = [sys.executable, __file__, "--measure", case, str(path), *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"data_sources: case {case!r} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure[0], Path(args.measure[1]), args)))
        return
    if args.out is None:
        raise SystemExit("data_sources: --out DIR is needed")
    passed = _without_value(argv, "--out")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        jsonl, parquet = write_data(Path(tmp), args.conversations, args.seed, args.row_group)
        made_s = time.perf_counter() - t0
        sizes = {"jsonl_bytes": jsonl.stat().st_size, "parquet_bytes": parquet.stat().st_size}
        cases = CASES + (IN_MEMORY if args.in_memory else ())
        rows = [run_case(case, jsonl if case.startswith("jsonl") else parquet, passed) for case in cases]
    full = {r["case"]: r for r in rows if "digest" in r}
    if len({r["digest"] for r in full.values()}) != 1:
        raise SystemExit("data_sources: the cases gave different samples for the same conversations")
    for r in rows:
        r.pop("digest", None)
    result = BenchResult(
        name="data_sources",
        config={
            "conversations": args.conversations,
            **sizes,
            "parquet_row_group": args.row_group,
            "token_budget": args.token_budget,
            "tokenize_workers": args.tokenize_workers,
            "tokenizer": "bundled demo tokenizer",
            "generate_seconds": made_s,
            "seed": args.seed,
        },
        rows=rows,
        summary={
            "same_samples": True,
            "first_batch_s": {k: full[k]["seconds"] for k in full},
            "peak_rss_mib": {r["case"]: r["peak_rss_mib"] for r in rows},
            "notes": [
                "each case in a fresh process; seconds count from after the imports and the tokenizer load",
                "rss_before_mib: after those imports (parquet: with datasets/pyarrow, rss_extra_imports_mib); "
                "rss_growth_mib: peak RSS above it, what reading (and keeping the samples) took",
                "first batch = load_samples (every sample tokenized into the store, or the store reused) + "
                "plan_batches + the batch's samples; the samples' digest is taken after the clock",
            ],
        },
        chart={"x": "case", "y": "peak_rss_mib", "title": f"{args.conversations:,} conversations"},
    )
    save_result(result, args.out)
    show_result(result, Console(stderr=True))


def _without_value(argv: list[str], flag: str) -> list[str]:
    """``argv`` less ``flag`` and its value (``--out DIR`` or ``--out=DIR``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
