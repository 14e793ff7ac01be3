"""The noise behind issue 31's "two nodes train like one" test, rerun: loss curves of one node of four CPU
workers (per seed), of two simulated nodes of two with --min-workers 4, and of two nodes started the old way
(no --min-workers: the first node's workers step alone until the second joins).

Run:  python bench/multinode_curves.py --out DIR [--one-seeds 0,0,0,1,2,3] [--two 2] [--old 2]
Each run is the test's own (`tests/integration/test_multinode_cpu.py`: 160 demo conversations, 2 epochs,
token budget 256, a loss row every step); it prints and writes DIR/curves.json with, per run, the steps,
the world sizes, the knee (share of samples trained when the loss first falls below 5), the mean loss per
progress quarter and the late mean (quarters 2-4) the test compares. About 35-80 s a run on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "integration")]

import test_multinode_cpu as t  # noqa: E402

from tests.launch_flags import demo_subset  # noqa: E402


def measure(kind: str, seed: int, root: Path) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    data = demo_subset(root / "data.jsonl", t.CURVE_SAMPLES)
    args = ["--token-budget", "256", "--seed", str(seed)] + (["--min-workers", "4"] if kind != "old" else [])
    if kind == "one":
        run, node = t.one_node(root, data, *args), None
    else:
        run, node = t.two_nodes(root, data, *args)
    t.finish(run, node, root / "node1.log")
    points = t.curve(run.run_dir)
    windows = t.window_means(points)
    return {
        "kind": kind,
        "seed": seed,
        "steps": len(points),
        "world_sizes": sorted({r["world_size"] for r in points}),
        "knee": round(t.knee(points), 3),
        "quarter_means": [round(x, 3) for x in windows],
        "late_mean": round(t.late_mean(windows), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--one-seeds", default="0,0,0,1,2,3", help="One-node runs, one per seed listed.")
    parser.add_argument("--two", type=int, default=2, help="Two-node runs with --min-workers 4 (seed 0).")
    parser.add_argument("--old", type=int, default=2, help="Two-node runs without --min-workers (seed 0).")
    args = parser.parse_args()
    plan = [("one", int(s)) for s in args.one_seeds.split(",") if s.strip()]
    plan += [("two", 0)] * args.two + [("old", 0)] * args.old
    results = []
    for i, (kind, seed) in enumerate(plan):
        results.append(measure(kind, seed, args.out / f"{i}-{kind}-seed{seed}"))
        print(json.dumps(results[-1]), flush=True)
    (args.out / "curves.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
