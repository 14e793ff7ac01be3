"""Producers attaching to a running run raise its supply in the same run (issue 31), on CPU nodes.

Node 0 runs the coordinator (`dflash-pipe launch --device cpu`, the demo target, WORKERS drafters); every
PHASE seconds of training another node attaches (`dflash-pipe producer --connect`, its own target replica
and WORKERS drafters, marked as another node with DFLASH_PIPE_NODE: features between nodes are counted as
remote and no ring is shared). Each node is pinned to its own CORES cores (children inherit the mask), so
on a host with NODES x CORES cores every node computes on its own, as on separate machines. After the last
phase the coordinator gets SIGTERM (a cluster's stop: finish the step, checkpoint, DONE to every producer).

Run:  python bench/attach_supply.py --out DIR [--nodes 3] [--workers 2] [--cores 5] [--phase-s 60]
Writes DIR/summary.json (dflash_pipe.bench.attach.summarize: supply and trained tokens/s per phase, the
ledger, feature bytes per link) and DIR/{coordinator,node1,...}.log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_pipe.bench.attach import read_rows, summarize  # noqa: E402
from dflash_pipe.bench.save import provenance  # noqa: E402
from dflash_pipe.data.demo import demo_data_path  # noqa: E402
from dflash_pipe.run.dir import RunDir  # noqa: E402


def start(cmd: list[str], *, cores: set[int], node: str | None, log: Path) -> subprocess.Popen:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    if node:
        env["DFLASH_PIPE_NODE"] = node
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "dflash_pipe", *cmd],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            preexec_fn=lambda: os.sched_setaffinity(0, cores),
        )


def wait_for(log: Path, pattern: str, proc: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (found := re.search(pattern, log.read_text(errors="replace"))) is not None:
            return found
        if proc.poll() is not None:
            raise SystemExit(
                f"{log.name}: exited with {proc.returncode} before {pattern!r}:\n{log.read_text()}"
            )
        time.sleep(0.5)
    raise SystemExit(f"{log.name}: no {pattern!r} in {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--nodes", type=int, default=3, help="The coordinator's node and NODES-1 attaching.")
    parser.add_argument("--workers", type=int, default=2, help="Drafter workers per node.")
    parser.add_argument("--cores", type=int, default=5, help="Cores per node (node k: cores k*CORES...).")
    parser.add_argument("--phase-s", type=float, default=60.0, help="Seconds of training per phase.")
    parser.add_argument("--samples", type=int, default=2000, help="Demo conversations in the data.")
    args = parser.parse_args()
    have = len(os.sched_getaffinity(0))
    if args.nodes * args.cores > have:
        raise SystemExit(
            f"--nodes {args.nodes} x --cores {args.cores} > the {have} cores this process may use"
        )
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data.jsonl"
    data.write_text("\n".join(demo_data_path().read_text().splitlines()[: args.samples]) + "\n")
    run_dir = out / "run"
    cores = [set(range(k * args.cores, (k + 1) * args.cores)) for k in range(args.nodes)]
    common = ["--token-budget", "1024", "--max-length", "256", "--responses", "dataset"]
    coordinator_log = out / "coordinator.log"
    coordinator = start(
        ["launch", "--plain", "--device", "cpu", "--workers", str(args.workers), "--run-dir", str(run_dir)]
        + ["--data", str(data), "--epochs", "50", "--eval-generate", "off", "--eval-samples", "8", *common],
        cores=cores[0],
        node=None,
        log=coordinator_log,
    )
    nodes: list[subprocess.Popen] = []
    attach_times: list[float] = []
    try:
        address = wait_for(coordinator_log, r"producer at (tcp://\S+?),", coordinator, 600).group(1)
        metrics = RunDir(run_dir).metrics
        while not any("loss" in r for r in read_rows(metrics)):  # phase 1 starts with training
            if coordinator.poll() is not None:
                raise SystemExit(coordinator_log.read_text())
            time.sleep(1)
        for k in range(1, args.nodes):
            time.sleep(args.phase_s)
            name = f"node{k}"
            cmd = ["producer", "--connect", address, "--device", "cpu", "--workers", str(args.workers)]
            nodes.append(start(cmd + ["--name", name], cores=cores[k], node=name, log=out / f"{name}.log"))
            attach_times.append(time.time())
            print(f"attached {name} at {time.strftime('%H:%M:%S')}", flush=True)
        time.sleep(args.phase_s)
        coordinator.send_signal(signal.SIGTERM)
        codes = {"coordinator": coordinator.wait(timeout=600)}
        codes.update({f"node{k + 1}": p.wait(timeout=120) for k, p in enumerate(nodes)})
    finally:
        for p in (coordinator, *nodes):
            if p.poll() is None:
                p.kill()
    summary = summarize(run_dir, [f"node{k}" for k in range(1, args.nodes)])
    supply = [p["supply_tokens_per_s"] for p in summary["phases"]]
    summary.update(
        {
            "exit_codes": codes,
            "attach_times": attach_times,
            "config": vars(args) | {"out": str(args.out)},
            "supply_rises_with_each_producer": all(
                a is not None and b is not None and b > a for a, b in zip(supply, supply[1:], strict=False)
            ),
            "provenance": provenance(),
        }
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        json.dumps({k: summary[k] for k in ("phases", "duplicates", "feature_bytes", "exit_codes")}, indent=2)
    )


if __name__ == "__main__":
    main()
