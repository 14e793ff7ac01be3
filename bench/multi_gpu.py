"""Multi-GPU runs of issue 8: drafter scaling, producer scaling, elastic attach/SIGKILL, design topology.

Each subcommand writes OUT/<name>.json (provenance, config, rows, summary) and a PNG, and prints a table:

  PYTHONPATH=. python bench/multi_gpu.py scaling-drafters --out OUT --target-model T --data D
  PYTHONPATH=. python bench/multi_gpu.py scaling-producer --out OUT --target-model T --data D
  PYTHONPATH=. python bench/multi_gpu.py elastic          --out OUT --target-model T --data D
  PYTHONPATH=. python bench/multi_gpu.py topology         --out OUT --target-model T --data D

On CUDA the GPUs come from the issue's design topology for the visible GPU count (`design_topology`:
x2 -> target 0 / drafters 1, x4 -> 0-1 / 2-3, x8 -> 0-4 / 5-7); --target-gpus / --drafter-gpus override it.
With --device cpu (demo target by default, tiny settings) every subcommand runs on this machine's CPU cores.
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set here, before torch
starts, so every process these runs start inherits them. `bench/multi_gpu_commands.sh` runs them all.

Past 400 lines because the four runs share their topology, options and metrics reading, and a multi-GPU
session runs them from one script: splitting it would spread one experiment over files.
"""

from __future__ import annotations

import os

from dflash_pipe.worker_pool import SAFE_GPU_ENV, worker_command

os.environ.update(SAFE_GPU_ENV)  # before torch (and NCCL) load, and inherited by every child process

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from dflash_pipe.bench.result import BenchResult  # noqa: E402
from dflash_pipe.bench.save import goal, save_result, show_result  # noqa: E402
from dflash_pipe.commands.options import add_field_arguments, field_argv, field_params  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCALING_GOAL = 0.95
RUN_FIELDS = (
    "target_model",
    "data.path",
    "data.token_budget",
    "data.max_length",
    "data.responses",
    "drafter.num_layers",
    "drafter.max_anchors",
    "train.compile",
)
"""The `launch` options these runs pass on (bench/make_target.py and bench/make_data.py make the model and data)."""
TOPOLOGIES = {1: ((0,), (0,)), 2: ((0,), (1,)), 4: ((0, 1), (2, 3)), 8: ((0, 1, 2, 3, 4), (5, 6, 7))}
"""Visible GPUs -> (target GPUs, drafter GPUs), as issue 8 asks (one GPU: both share GPU 0)."""


def design_topology(gpus: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if gpus not in TOPOLOGIES:
        raise ValueError(
            f"{gpus} GPUs visible: the design topology is defined for {sorted(TOPOLOGIES)} GPUs; "
            "pass --target-gpus and --drafter-gpus."
        )
    return TOPOLOGIES[gpus]


def gpu_spec(ids: tuple[int, ...]) -> str:
    return ",".join(str(i) for i in ids)


# --- configuration --------------------------------------------------------------------------------------


def run_opts(args: argparse.Namespace) -> dict[str, Any]:
    """The `launch` options of these runs (None = the default), with the GPUs of the design topology."""
    opts: dict[str, Any] = {name: getattr(args, name) for name in field_params(*RUN_FIELDS)}
    opts.update(device=args.device, eval_samples=0)
    if args.device == "cpu":
        opts["workers"] = args.workers
    else:
        target, drafters = args.target_gpus, args.drafter_gpus
        if not (target and drafters):  # both given: any GPU count will do
            import torch

            design = design_topology(torch.cuda.device_count())
            target, drafters = target or gpu_spec(design[0]), drafters or gpu_spec(design[1])
        opts["target_gpus"], opts["drafter_gpus"] = target, drafters
    return opts


def bench_config(args: argparse.Namespace, work_dir: Path):
    from dflash_pipe.bench.throughput import bench_run_config
    from dflash_pipe.commands.launch_config import build_run_config

    cfg, _ = build_run_config({**run_opts(args), "run_dir": work_dir / "prepare"})
    return bench_run_config(cfg, work_dir)


def with_layout(work, **changes):
    """The same prepared work (data, tokenizer, target path) with another layout."""
    layout = dataclasses.replace(work.cfg.layout, **changes)
    cfg = dataclasses.replace(work.cfg, layout=layout)
    return dataclasses.replace(work, cfg=cfg, ctx=dataclasses.replace(work.ctx, cfg=cfg))


def scaling_counts(pool: int, limit: int | None) -> list[int]:
    top = pool if limit is None else min(pool, limit)
    return list(range(1, top + 1))


def efficiency(rate: float, count: int, base: float) -> float | None:
    """rate at ``count`` devices over ``count`` x the one-device rate (1.0 = linear)."""
    return round(rate / (count * base), 3) if base > 0 else None


def describe(args: argparse.Namespace, work) -> dict[str, Any]:
    layout = work.cfg.layout
    return {
        "device": layout.device,
        "target_model": str(work.cfg.target_model) if work.cfg.target_model else "demo",
        "data": str(work.cfg.data.path),
        "target_devices": layout.target_devices(),
        "worker_devices": layout.worker_devices(),
        "token_budget": work.cfg.data.token_budget,
        "max_length": work.cfg.data.max_length,
        "draft_layers": work.ctx.drafter.num_hidden_layers,
        "max_anchors": work.ctx.drafter.max_anchors,
        "compile": work.cfg.train.compile,
        "seconds": args.seconds,
        "safe_gpu_env": {k: os.environ.get(k) for k in SAFE_GPU_ENV},
    }


# --- 1. drafter scaling -----------------------------------------------------------------------------------


def scaling_drafters(args: argparse.Namespace, work_dir: Path, say: Callable[[str], None]) -> BenchResult:
    """For 1, 2, ... drafter workers on the same producer: the drafters alone (synthetic features, the real
    group and its gradient all-reduce) and a real launch (pipeline), each against linear from one worker."""
    from dflash_pipe.bench.stages import drafters_alone, prepare_work, producer_alone
    from dflash_pipe.bench.throughput import run_pipeline

    work = prepare_work(bench_config(args, work_dir))
    layout = work.cfg.layout
    pool = layout.cpu_workers if layout.device == "cpu" else len(layout.drafter_gpus)
    say(f"producer alone ({args.seconds:g} s): the pipeline's ceiling")
    producer = producer_alone(work, args.seconds).tokens_per_s
    rows, per_worker = [], {}
    for k in scaling_counts(pool, args.max_count):
        changes = {"cpu_workers": k} if layout.device == "cpu" else {"drafter_gpus": layout.drafter_gpus[:k]}
        work_k = with_layout(work, **changes)
        work_k.work_dir = work_dir / f"drafters-{k}" / "work"  # run_pipeline's run dir is its sibling
        work_k.work_dir.mkdir(parents=True, exist_ok=True)
        say(f"{k} drafter worker(s): drafters alone, then a launch")
        alone = drafters_alone(work_k, args.seconds)
        per_worker[str(k)] = alone.extra["per_worker"]
        pipeline, waits = run_pipeline(work_k, args.seconds, min(producer, alone.tokens_per_s), mode=None)
        rows.append(
            {
                "workers": k,
                "worker_devices": ",".join(work_k.cfg.layout.worker_devices()),
                "drafters_alone_tokens_per_s": round(alone.tokens_per_s, 1),
                "drafters_alone_window_s": round(alone.seconds, 3),
                "pipeline_tokens_per_s": round(pipeline.tokens_per_s, 1),
                "pipeline_steps": pipeline.extra["steps"],
                "target_idle_share": round(waits.get("target_idle_share", float("nan")), 3),
                "workers_starved_share": round(waits.get("workers_starved_share", float("nan")), 3),
            }
        )
    for key in ("drafters_alone", "pipeline"):
        base = rows[0][f"{key}_tokens_per_s"]
        for row in rows:
            row[f"{key}_efficiency"] = efficiency(row[f"{key}_tokens_per_s"], row["workers"], base)
    last = rows[-1]
    summary = {
        "producer_alone_tokens_per_s": round(producer, 1),
        "max_workers": last["workers"],
        "drafters_alone_efficiency": last["drafters_alone_efficiency"],
        "pipeline_efficiency": last["pipeline_efficiency"],
        "goals": [
            goal(
                "drafters alone scaling vs linear", last["drafters_alone_efficiency"], at_least=SCALING_GOAL
            ),
            goal("pipeline drafter scaling vs linear", last["pipeline_efficiency"], at_least=SCALING_GOAL),
        ],
        "notes": _drafter_notes(work.cfg.layout, last, producer),
        "drafters_alone_per_worker": per_worker,  # each worker's steps and ACK window, per worker count
    }
    chart = {
        "x": "workers",
        "y": "pipeline_tokens_per_s",
        "kind": "line",
        "title": "tokens/s by drafter workers",
    }
    return BenchResult(
        name="scaling-drafters", config=describe(args, work), rows=rows, summary=summary, chart=chart
    )


def _drafter_notes(layout, last: dict, producer: float) -> list[str]:
    notes = ["efficiency = tokens/s at k workers / (k x tokens/s at one worker); goal >= 0.95"]
    if layout.device == "cpu":
        notes.append("CPU: the workers share this machine's cores, so scaling here is not a GPU figure")
    elif shared := layout.shared_gpus():
        notes.append(f"GPU(s) {shared} host the target and a drafter: the pipeline rows include that sharing")
    if last["pipeline_tokens_per_s"] >= 0.9 * producer:
        notes.append(
            f"the pipeline ran at >= 0.9x the producer alone ({producer:.0f} tokens/s): the target, not the "
            "drafters, capped it; the drafters-alone rows show the drafters' own scaling"
        )
    return notes


# --- 2. producer scaling ----------------------------------------------------------------------------------


def scaling_producer(args: argparse.Namespace, work_dir: Path, say: Callable[[str], None]) -> BenchResult:
    """Producer alone (target replicas, features dropped) on 1, 2, ... target GPUs, against linear."""
    from dflash_pipe.bench.stages import prepare_work, producer_alone

    work = prepare_work(bench_config(args, work_dir))
    layout = work.cfg.layout
    pool = 1 if layout.device == "cpu" else len(layout.target_gpus)  # on CPU one replica uses every core
    rows = []
    for k in scaling_counts(pool, args.max_count):
        work_k = work if layout.device == "cpu" else with_layout(work, target_gpus=layout.target_gpus[:k])
        say(f"producer alone on {k} target device(s) ({args.seconds:g} s)")
        rate = producer_alone(work_k, args.seconds)
        rows.append(
            {
                "target_devices": ",".join(work_k.cfg.layout.target_devices()),
                "gpus": k,
                "replicas": rate.extra["replicas"],
                "batches": rate.extra["batches"],
                "tokens_per_s": round(rate.tokens_per_s, 1),
            }
        )
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["efficiency"] = efficiency(row["tokens_per_s"], row["gpus"], base)
    notes = ["efficiency = tokens/s on k GPUs / (k x tokens/s on one GPU); goal >= 0.95 when one GPU fits"]
    if layout.device == "cpu":
        notes.append("CPU: one target replica uses every core, so there is a single point")
    if any(row["replicas"] != row["gpus"] for row in rows):
        notes.append("the target did not fit one GPU: it was split by layers, so linear is not expected")
    summary = {
        "max_gpus": rows[-1]["gpus"],
        "efficiency": rows[-1]["efficiency"],
        "goals": [goal("producer scaling vs linear", rows[-1]["efficiency"], at_least=SCALING_GOAL)],
        "notes": notes,
    }
    chart = {
        "x": "gpus",
        "y": "tokens_per_s",
        "kind": "line",
        "title": "producer alone tokens/s by target GPUs",
    }
    return BenchResult(
        name="scaling-producer", config=describe(args, work), rows=rows, summary=summary, chart=chart
    )


# --- 3. elastic: attach a worker, SIGKILL it --------------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, **SAFE_GPU_ENV, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Launch:
    """A `dflash-pipe launch --plain` subprocess; its stderr lines are collected for its address and errors."""

    def __init__(self, run_dir: Path, argv: list[str]) -> None:
        self.run_dir = run_dir
        cmd = [sys.executable, "-m", "dflash_pipe", "launch", "--plain", "--run-dir", str(run_dir), *argv]
        self.proc = subprocess.Popen(
            cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
        )
        self.lines: list[str] = []
        self.out: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.lines), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.out), daemon=True).start()

    @staticmethod
    def _pump(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    def log(self) -> str:
        return "".join(self.out[-40:] + self.lines[-40:])

    def address(self, timeout: float) -> str:
        import re

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.out + self.lines:
                if found := re.search(r"producer at (tcp://\S+?),", line):
                    return found.group(1)
            self._alive()
            time.sleep(0.2)
        raise RuntimeError(f"launch printed no producer address within {timeout:.0f} s:\n{self.log()}")

    def row(self, test: Callable[[dict], bool], timeout: float, after: float = 0.0) -> dict:
        """The first metrics row written after ``after`` (unix time) that passes ``test``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for row in _metrics(self.run_dir):
                if row["time"] >= after and test(row):
                    return row
            self._alive()
            time.sleep(0.1)
        raise RuntimeError(
            f"{self.run_dir}/metrics.jsonl: no expected row within {timeout:.0f} s:\n{self.log()}"
        )

    def _alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"launch exited with {self.proc.returncode}:\n{self.log()}")


def first_samples(data: Path | None, n: int, out: Path) -> Path:
    """The first ``n`` lines of ``data`` (default: the demo's), so one epoch stays short."""
    from dflash_pipe.data import demo_data_path

    with open(data or demo_data_path()) as f:
        lines = [line for _, line in zip(range(n), f, strict=False)]
    out.write_text("".join(lines))
    return out


def elastic_devices(args: argparse.Namespace) -> tuple[list[str], str]:
    """(launch flags for the layout, the attached worker's device): the launch leaves one drafter device
    free for the attach; with a single drafter GPU the attach shares the target's first GPU."""
    if args.device == "cpu":
        return ["--device", "cpu", "--workers", str(args.workers)], "cpu"
    opts = run_opts(args)
    from dflash_pipe.run.layout import parse_gpu_spec

    target = parse_gpu_spec(opts["target_gpus"], flag="--target-gpus")
    drafters = parse_gpu_spec(opts["drafter_gpus"], flag="--drafter-gpus")
    launched, free = (drafters[:-1], drafters[-1]) if len(drafters) > 1 else (drafters, target[0])
    layout = ["--device", "cuda", "--target-gpus", gpu_spec(target), "--drafter-gpus", gpu_spec(launched)]
    return layout, f"cuda:{free}"


def elastic(args: argparse.Namespace, work_dir: Path, say: Callable[[str], None]) -> BenchResult:
    """One epoch of a launch; once it trains, a `dflash-pipe worker --connect` joins on a free device, and
    after the group of n+1 trained a step, that worker is SIGKILLed. Recovery = from the kill to the first
    acked step of the remaining group; the final checkpoint's ledger shows whether any sample was lost."""
    from dflash_pipe.run.checkpoint import latest_checkpoint, read_trainer_state
    from dflash_pipe.run.ledger import Ledger

    layout, free = elastic_devices(args)
    run_dir = work_dir / "elastic-run"
    argv = [*layout, "--epochs", "1", "--eval-samples", "0", "--reconnect-timeout", "5"]
    # a metrics row each step, not each tenth: the join, the kill and the recovery are timed to the step
    every_step = work_dir / "log-every-step.yaml"
    every_step.write_text("train:\n  log_every: 1\n")
    argv += ["--config", str(every_step)]
    opts = run_opts(args)
    if args.samples:
        opts["data_path"] = first_samples(args.data_path, args.samples, work_dir / "data.jsonl")
    argv += field_argv(opts, *RUN_FIELDS)
    say(f"launch ({' '.join(layout)}), one epoch")
    run = Launch(run_dir, argv)
    attached = None
    try:
        address = run.address(timeout=args.timeout)
        first = run.row(lambda r: "loss" in r, timeout=args.timeout)
        launched = int(first["world_size"])
        say(f"training with {launched} worker(s); attaching one on {free}")
        log = work_dir / "attached.log"
        cmd = worker_command(address, free, name="attached", reconnect_timeout_s=5)
        t_attach = time.time()
        with open(log, "wb") as out:
            attached = subprocess.Popen(cmd, env=_env(), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        joined = run.row(
            lambda r: r.get("world_size") == launched + 1 and "loss" in r, args.timeout, t_attach
        )
        say(f"group of {launched + 1} trained step {joined['step']}; SIGKILL the attached worker")
        os.kill(attached.pid, signal.SIGKILL)
        t_kill = time.time()
        attached.wait(timeout=30)
        back = run.row(lambda r: r.get("world_size") == launched and "loss" in r, args.timeout, t_kill)
        say("waiting for the epoch to finish")
        rc = run.proc.wait(timeout=args.timeout)
        if rc != 0:
            raise RuntimeError(f"launch exited with {rc}:\n{run.log()}")
    finally:
        for proc in (attached, run.proc):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    state = read_trainer_state(latest_checkpoint(run_dir))
    ledger = Ledger.from_dict(state.ledger)
    rows_all = _metrics(run_dir)
    released = max((r.get("released_samples", 0) for r in rows_all), default=0)
    lost = ledger.num_samples - ledger.count(0)
    regroups = [r for r in rows_all if r["time"] >= t_kill and "generation" in r]
    row = {
        "launched_workers": launched,
        "attached_device": free,
        "join_s": round(joined["time"] - t_attach, 2),
        "join_step": joined["step"],
        "kill_step": max(r["step"] for r in rows_all if r["time"] <= t_kill),
        "recovery_s": round(back["time"] - t_kill, 2),
        "regroup_s": regroups[0].get("regroup_s") if regroups else None,
        "final_step": state.step,
        "samples": ledger.num_samples,
        "samples_lost": lost,
        "duplicates": ledger.duplicates,
        "released_samples": released,
        "epoch_complete": ledger.complete(0),
    }
    summary = {
        "recovery_s": row["recovery_s"],
        "samples_lost": lost,
        "epoch_complete": row["epoch_complete"],
        "goals": [goal("samples lost after the SIGKILL", lost, at_most=0)],
        "notes": [
            "recovery_s: from the SIGKILL to the first acked step (metrics row) of the remaining group",
            "duplicates: samples trained twice because they were leased to the killed worker (<= released)",
        ],
    }
    return BenchResult(
        name="elastic", config=describe_elastic(args, layout, free), rows=[row], summary=summary
    )


def describe_elastic(args: argparse.Namespace, layout: list[str], free: str) -> dict[str, Any]:
    return {
        "launch_layout": " ".join(layout),
        "attached_device": free,
        "target_model": str(args.target_model or "demo"),
        "data": str(args.data_path or "demo"),
        "safe_gpu_env": {k: os.environ.get(k) for k in SAFE_GPU_ENV},
    }


# --- 4. the design topology: bench throughput --compare -------------------------------------------------


def topology(args: argparse.Namespace, work_dir: Path, say: Callable[[str], None]) -> BenchResult:
    """`dflash-pipe bench throughput --compare` on the design topology (NCCL gradients on CUDA, the
    payload path negotiated automatically): pipeline efficiency and where the time goes."""
    from dflash_pipe.bench.throughput import run_throughput_bench
    from dflash_pipe.commands.launch_config import build_run_config

    cfg, _ = build_run_config({**run_opts(args), "run_dir": work_dir / "prepare"})
    result = run_throughput_bench(
        cfg, seconds=args.seconds, work_dir=work_dir, compare=not args.no_compare, progress=say
    )
    result.name = "topology"
    result.config["payload_path"] = cfg.wire.payload_path
    result.config["gradient_backend"] = "nccl" if cfg.layout.device == "cuda" else "gloo"
    result.config["safe_gpu_env"] = {k: os.environ.get(k) for k in SAFE_GPU_ENV}
    return result


COMMANDS = {
    "scaling-drafters": scaling_drafters,
    "scaling-producer": scaling_producer,
    "elastic": elastic,
    "topology": topology,
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=sorted(COMMANDS))
    p.add_argument("--out", type=Path, required=True, help="Results directory (OUT/<command>.json).")
    p.add_argument("--work", type=Path, help="Scratch dir (run dirs, logs); default OUT/work-<command>.")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--target-gpus", help="Override the design topology's target GPUs, e.g. 0-1.")
    p.add_argument("--drafter-gpus", help="Override the design topology's drafter GPUs, e.g. 2-3.")
    p.add_argument("--workers", type=int, default=2, help="CPU: drafter workers (the most in scaling).")
    p.add_argument("--max-count", type=int, help="Scaling: stop at this many devices/workers.")
    p.add_argument("--seconds", type=float, default=10.0, help="Measured seconds per stage.")
    add_field_arguments(p, *RUN_FIELDS, unset=True)  # as `launch` takes them; untyped: launch's default
    p.add_argument("--samples", type=int, help="Elastic: one epoch of the data's first N samples.")
    p.add_argument("--timeout", type=float, default=300.0, help="Elastic: seconds to wait for each event.")
    p.add_argument(
        "--no-compare",
        action="store_true",
        help="Topology: the stages and the pipeline only (no offline/threads).",
    )
    return p


def run_command(args: argparse.Namespace) -> tuple[BenchResult, dict[str, Path]]:
    """Runs one subcommand with its scratch under OUT/work-<command>; returns its result and files."""
    work_dir = (args.work or args.out / f"work-{args.command}").resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {args.command}: {text}", flush=True)

    result = COMMANDS[args.command](args, work_dir, say)
    result.config["wall_s"] = round(time.perf_counter() - t0, 1)
    return result, save_result(result, args.out)


def main() -> None:
    from rich.console import Console

    args = parser().parse_args()
    result, paths = run_command(args)
    show_result(result, Console())
    print(f"wrote {', '.join(str(p) for p in paths.values())}")


if __name__ == "__main__":
    main()
