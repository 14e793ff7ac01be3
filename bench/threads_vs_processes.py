"""Threaded drafters on one device: cold-cache safety, activation checkpointing cost, threads vs processes.

Run (H200, < 5 min):  PYTHONPATH=. python bench/threads_vs_processes.py --out DIR
CPU smoke test:       PYTHONPATH=. python bench/threads_vs_processes.py --out DIR --tiny --steps 2

Three parts, each in fresh child processes, written to DIR/threads_vs_processes.json:

1. ``cold``: ``--threads`` drafters as threads of one process, compiled attention (flex on CUDA; compiled
   SDPA layers on CPU), ``--cold-checkpointing`` (default all), on an empty inductor/triton cache, no
   warm-up: every first call goes through the compile guard. Repeated ``--repeats`` times; each must end
   with no error.
2. ``checkpointing``: one drafter, step time (median) and peak memory for none / layers / loss / all.
3. ``threads_vs_processes``: ``--threads`` drafters as threads of one process vs as that many processes,
   all on the same device and warm cache; aggregate steps/s and per-drafter step time.

Each drafter step is forward + backward + AdamW on its own weights (no gradient exchange: this measures
how the drafters share the device, not the group's collectives).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--threads", type=int, default=3, help="drafters on the one device")
    p.add_argument("--steps", type=int, default=6, help="timed steps per drafter")
    p.add_argument("--repeats", type=int, default=2, help="cold-cache threaded runs")
    p.add_argument("--cold-checkpointing", default="all", choices=["none", "layers", "loss", "all"])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument(
        "--parts",
        default="cold,checkpointing,versus",
        help="comma-separated sections to run: cold, checkpointing, versus (threads vs processes)",
    )
    p.add_argument("--role", default=None, help=argparse.SUPPRESS)  # child mode
    p.add_argument("--checkpointing", default="none", help=argparse.SUPPRESS)
    p.add_argument("--warmup-steps", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--barrier", default=None, help=argparse.SUPPRESS)  # dir: start timing together
    return p.parse_args(argv)


def shapes(tiny: bool) -> dict:
    if tiny:
        return dict(
            hidden=64,
            heads=4,
            kv_heads=2,
            head_dim=16,
            inter=128,
            vocab=500,
            layers=2,
            context=128,
            anchors=8,
        )
    # A smaller drafter layer than the Qwen3-8B shape (H 2048): three fit on one GPU with room.
    return dict(
        hidden=2048,
        heads=16,
        kv_heads=8,
        head_dim=128,
        inter=6144,
        vocab=151936,
        layers=2,
        context=2048,
        anchors=256,
    )


def build(sh: dict, device, *, threaded: bool, checkpointing: str, seed: int = 0):
    """bench/drafter_step.py's drafter and inputs (batch 1, block 16), with this run's checkpointing."""
    import torch

    from dflash_pipe.drafter.checkpointing import CheckpointPolicy
    from dflash_pipe.train.build import apply_checkpointing

    sys.path.insert(0, str(Path(__file__).parent))
    from drafter_step import build as build_drafter

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape_args = argparse.Namespace(block_size=16, batch=1, compile_parts="layers")  # as training runs it
    backend = "flex" if device.type == "cuda" else "sdpa"
    model, inputs = build_drafter(sh, shape_args, backend, device, dtype, seed=seed)
    apply_checkpointing(model, CheckpointPolicy(checkpointing, mode="threaded" if threaded else "process"))
    return model, torch.optim.AdamW(model.trainable_parameters(), lr=1e-5), inputs


def train_steps(model, opt, inputs, n: int, device, backward) -> list[float]:
    """n steps; seconds per step."""
    import torch

    times = []
    for i in range(n):
        t0 = time.perf_counter()
        gen = torch.Generator(device=device).manual_seed(i)
        out = model(*inputs, generator=gen)
        backward(out.loss_sum / out.weight_sum.clamp_min(1))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def child(args: argparse.Namespace) -> dict:
    """One measurement in this (fresh) process; returns its JSON row."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from dflash_pipe.compute.compile import apply_dynamo_settings, backward_with_settings
    from dflash_pipe.drafter.compile_guard import GUARD

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(args.threads, 1)))
    sh = shapes(args.tiny)
    apply_dynamo_settings()
    if args.role == "single":  # one drafter in this process: checkpointing rows and the processes case
        model, opt, inputs = build(sh, device, threaded=False, checkpointing=args.checkpointing)
        t0 = time.perf_counter()
        first = train_steps(model, opt, inputs, 1, device, backward_with_settings)
        train_steps(model, opt, inputs, args.warmup_steps - 1, device, backward_with_settings)
        if args.barrier:  # concurrent processes: every one is warm before any timed step
            _barrier(Path(args.barrier), args.threads)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = train_steps(model, opt, inputs, args.steps, device, backward_with_settings)
        return {
            "first_step_s": first[0],
            "step_s": statistics.median(times),
            "wall_s": time.perf_counter() - t0,
            "peak_gib": _peak_gib(device),
        }
    # role "threads": args.threads drafters as threads, every step through the compile guard, no warm-up
    built = [
        build(sh, device, threaded=True, checkpointing=args.checkpointing, seed=i)
        for i in range(args.threads)
    ]
    errors: list[str] = []
    lock = threading.Lock()
    warm = threading.Barrier(args.threads)  # timed steps start together, once every thread is warm
    timed_window: list[float] = []

    def run(i: int) -> list[float]:
        model, opt, inputs = built[i]

        def one_step() -> list[float]:
            return train_steps(model, opt, inputs, 1, device, backward_with_settings)

        def reset() -> None:
            opt.zero_grad(set_to_none=True)

        times = []
        try:
            for n in range(args.warmup_steps + args.steps):
                if n == args.warmup_steps:
                    warm.wait(timeout=900)
                    with lock:
                        timed_window.append(time.perf_counter())
                times += GUARD.run(one_step, reset=reset)
            with lock:
                timed_window.append(time.perf_counter())
        except Exception as exc:  # recorded and reported: a clean run is the figure being measured
            with lock:
                errors.append(f"thread {i}: {type(exc).__name__}: {exc}")
            warm.abort()
        return times

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    with GUARD.threaded(), ThreadPoolExecutor(args.threads, initializer=apply_dynamo_settings) as pool:
        per_thread = list(pool.map(run, range(args.threads)))
    wall = time.perf_counter() - t0
    timed = [t[args.warmup_steps :] for t in per_thread if len(t) > args.warmup_steps]
    clean = not errors and len(timed) == args.threads
    return {
        "errors": errors,
        "clean": clean,
        "exclusive_steps": GUARD.exclusive_runs,
        "first_step_s": max((t[0] for t in per_thread if t), default=None),
        "wall_s": wall,
        "step_s": statistics.median([x for t in timed for x in t]) if timed else None,
        "steps_per_s": args.threads * args.steps / (max(timed_window) - min(timed_window)) if clean else None,
        "peak_gib": _peak_gib(device),
    }


def _barrier(folder: Path, parties: int, timeout_s: float = 600.0) -> None:
    (folder / f"ready-{os.getpid()}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(folder.glob("ready-*"))) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(list(folder.glob('ready-*')))} of {parties} processes got ready")
        time.sleep(0.05)


def _peak_gib(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def spawn(
    args: argparse.Namespace, role: str, *, cache: str, checkpointing: str, barrier: str | None = None
) -> subprocess.Popen:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    cmd = [sys.executable, os.path.abspath(__file__), "--out", str(args.out), "--role", role]
    cmd += ["--checkpointing", checkpointing, "--threads", str(args.threads), "--steps", str(args.steps)]
    cmd += ["--warmup-steps", str(args.warmup_steps)] + (["--tiny"] if args.tiny else [])
    cmd += ["--barrier", barrier] if barrier else []
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)


def collect(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        return {"errors": [f"child exited with {proc.returncode}"], "clean": False}
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role:
        print(json.dumps(child(args)))
        return 0
    from dflash_pipe.bench.save import provenance  # after the child branch: children set their env first

    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    parts = set(args.parts.split(","))
    cold, checkpointing, vs = [], [], {}
    for r in range(args.repeats if "cold" in parts else 0):
        cache = tempfile.mkdtemp(prefix="dflash-bench-cold-")
        row = collect(spawn(args, "threads", cache=cache, checkpointing=args.cold_checkpointing))
        cold.append({"repeat": r, **row})
        print(f"cold threaded run {r}: {row}", file=sys.stderr, flush=True)
    warm_cache = tempfile.mkdtemp(prefix="dflash-bench-warm-")
    for what in ("none", "layers", "loss", "all") if "checkpointing" in parts else ():
        row = collect(spawn(args, "single", cache=warm_cache, checkpointing=what))
        checkpointing.append({"checkpointing": what, **row})
        print(f"checkpointing {what}: {row}", file=sys.stderr, flush=True)
    if "versus" in parts:
        threads = collect(spawn(args, "threads", cache=warm_cache, checkpointing="none"))
        barrier = tempfile.mkdtemp(prefix="dflash-bench-barrier-")
        procs = [
            spawn(args, "single", cache=warm_cache, checkpointing="none", barrier=barrier)
            for _ in range(args.threads)
        ]
        processes = [collect(p) for p in procs]
        vs = {
            "threads": threads,
            "processes": {
                "per_process": processes,
                "step_s": statistics.median(
                    [p["step_s"] for p in processes if "step_s" in p] or [float("nan")]
                ),
                "steps_per_s": sum(1 / p["step_s"] for p in processes if p.get("step_s")),  # timed together
            },
        }
        print(f"threads vs processes: {vs}", file=sys.stderr, flush=True)
    result = {
        "name": "threads_vs_processes",
        "config": {**vars(args), "out": str(args.out), "shapes": shapes(args.tiny)},
        "provenance": provenance(),
        "cold": cold,
        "checkpointing": checkpointing,
        "threads_vs_processes": vs,
        "summary": {
            "cold_runs_clean": all(r.get("clean") for r in cold),
            "parts": sorted(parts),
            "wall_s": time.time() - t0,
        },
    }
    path = args.out / "threads_vs_processes.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0 if result["summary"]["cold_runs_clean"] else 1


if __name__ == "__main__":
    sys.exit(main())
