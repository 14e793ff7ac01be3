"""`dflash-pipe bench compile`: time to first training step on a cold cache, a warm one, and N together.

Each case starts fresh worker processes (``python -m dflash_pipe.bench.child compile``) with the launcher's
worker environment (one shared TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR, bounded compile threads), which
build the drafter, run the worker's warm-up (``train.warmup.warm_up`` in each ``--compile-warmup`` mode:
each, all compile at once; once, one compiles under the cache's lock while the others wait and start warm)
and then one real training step. The figure is wall time from the process's start to the end of that
step.

  together  N workers started at once on an empty cache, as `launch` starts them, per mode (run first)
  cold      one worker on another empty cache
  warm      one worker on the cache the cold one left

Goal: the slowest of the N together within 1.2x of one worker's cold time. On CPU a worker compiles
nothing (flex attention has no CPU backward, so the CPU path is eager SDPA), so the bench compiles the
drafter's decoder layers (``torch.compile(dynamic=True)``) to measure a real compile, and says so.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dflash_pipe.bench.procs import start_children
from dflash_pipe.bench.result import BenchResult
from dflash_pipe.bench.save import goal

TOGETHER_GOAL = 1.2
CHILD_TIMEOUT_S = 1800.0
"""A worker start that takes longer than this is killed (a cold compile of big shapes takes minutes)."""
WORKER_WARMUP_BATCH_SIZES = (2, 1)
"""``train.warmup.warm_up``'s batch sizes: a worker compiles batch 2 and, as dynamic shapes specialise on
size 1, batch 1 again (a second whole compile: on CPU over a third of a cold start's CPU time)."""
CPU_SCALAR_NOTE = (
    "CPU kernels compiled without SIMD (TORCHINDUCTOR_VEC_ISA_OK=0, as the test suite sets it): the same "
    "Dynamo, AOT autograd, Inductor and g++ steps and cache, a fifth to a quarter less CPU time per cold start"
)
Progress = Callable[[str], None]


def run_compile_bench(
    *,
    target_model: Path | None,
    device: str,
    gpus: tuple[int, ...] = (0,),
    workers: int = 2,
    draft_layers: int | None = None,
    seq_len: int | None = None,
    warmups: tuple[str, ...] = ("once",),
    warmup_batch_sizes: tuple[int, ...] = WORKER_WARMUP_BATCH_SIZES,
    work_dir: Path,
    progress: Progress | None = None,
) -> BenchResult:
    """``warmups``: the ``train.compile_warmup`` modes to start the N workers together with, each on its
    own empty cache (once: the launcher's default lock; each: all compile at once).
    ``warmup_batch_sizes``: each worker's warm-up batches (a worker's own: 2 then 1, two compiled variants);
    the first step runs at the first. The children inherit this environment: torch's
    ``TORCHINDUCTOR_VEC_ISA_OK=0`` compiles CPU kernels scalar (``CPU_SCALAR_NOTE``), and the config says so."""
    say = progress or (lambda _text: None)
    if not warmups or set(warmups) - {"once", "each"}:
        raise ValueError(f"--compile-warmup takes once and/or each, got {','.join(warmups) or 'nothing'}.")
    if not warmup_batch_sizes or min(warmup_batch_sizes) < 1:
        raise ValueError(f"--warmup-batch-sizes takes sizes >= 1, got {warmup_batch_sizes}.")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}.")
    work_dir = Path(work_dir)
    cpu = device == "cpu"
    cpu_simd = os.environ.get("TORCHINDUCTOR_VEC_ISA_OK") != "0"  # torch's switch, which the children inherit
    layers = draft_layers or (1 if cpu else 5)
    length = seq_len or (256 if cpu else 2048)
    say("resolving the target and the drafter shape")
    spec = _drafter_spec(target_model, layers, device, progress=say)
    spec.update(
        compile_layers=cpu,
        step_seq_len=length,
        warmup_seq_len=length,
        warmup_batch_sizes=list(warmup_batch_sizes),
    )
    devices = ["cpu"] * workers if cpu else [f"cuda:{gpus[i % len(gpus)]}" for i in range(workers)]
    together_rows: list[dict[str, Any]] = []
    # The together cases run first: whatever a machine's first compile pays once (files not yet in the
    # page cache, the toolchain's first start) then lands on them, never on the cold worker they are
    # compared with, so the ratio can only err against the goal.
    together: dict[str, float] = {}
    for mode in warmups:
        say(f"together ({mode}): {workers} workers at once on an empty cache")
        mode_spec = {**spec, "train": {**spec["train"], "compile_warmup": mode}}
        name = "together" if mode == "once" else f"together-{mode}"
        results = _start_together(mode_spec, devices, work_dir / f"cache-{name}", work_dir / name)
        for i, r in enumerate(results):
            together_rows.append(_row(f"{name} #{i}", workers, r))
        together[mode] = max(r["first_step_s"] for r in results)
    cache = work_dir / "cache-single"
    say("cold: one worker, empty cache")
    cold = _start_together(spec, devices[:1], cache, work_dir / "cold")[0]
    say("warm: one worker, the cache the cold one filled")
    warm = _start_together(spec, devices[:1], cache, work_dir / "warm")[0]
    rows = [_row("cold", 1, cold), _row("warm", 1, warm), *together_rows]
    notes = []
    if cpu:
        notes.append(
            "CPU: a CPU worker compiles nothing (eager SDPA); this bench compiles the drafter's decoder "
            "layers with torch.compile(dynamic=True) so that it measures a real Inductor compile"
        )
        if not cpu_simd:
            notes.append(CPU_SCALAR_NOTE)
    summary = {
        "cold_s": round(cold["first_step_s"], 2),
        "warm_s": round(warm["first_step_s"], 2),
        "warm_vs_cold": round(warm["first_step_s"] / cold["first_step_s"], 3),
        **together_summary(together, cold["first_step_s"]),
        "goals": [
            goal(
                f"{workers} together ({mode}) / one cold",
                round(s / cold["first_step_s"], 3),
                at_most=TOGETHER_GOAL,
            )
            for mode, s in together.items()
        ],
        "notes": notes,
    }
    config = {
        "target_model": str(target_model) if target_model else "demo",
        "device": device,
        "worker_devices": devices,
        "workers": workers,
        "draft_layers": layers,
        "hidden_size": spec["drafter"]["hidden_size"],
        "seq_len": length,
        "compile_warmups": list(warmups),
        "warmup_batch_sizes": list(warmup_batch_sizes),
        "cpu_simd": cpu_simd if cpu else None,
        "compiled": "drafter decoder layers (bench, CPU)"
        if cpu
        else "flex attention + block mask (as a run)",
    }
    chart = {"x": "case", "y": "first_step_s", "kind": "bar", "title": "time to first step (s)"}
    return BenchResult(name="compile", config=config, rows=rows, summary=summary, chart=chart)


def together_summary(slowest: dict[str, float], cold_s: float) -> dict[str, float]:
    """The slowest worker of each warm-up mode and its ratio to one cold worker (``once`` keeps the
    original key names)."""
    out: dict[str, float] = {}
    for mode, s in slowest.items():
        suffix = "" if mode == "once" else f"_{mode}"
        out[f"together{suffix}_slowest_s"] = round(s, 2)
        out[f"together{suffix}_vs_cold"] = round(s / cold_s, 3)
    return out


def _row(case: str, workers: int, r: dict[str, Any]) -> dict[str, Any]:
    return {
        "case": case,
        "workers": workers,
        "first_step_s": round(r["first_step_s"], 2),
        "build_s": round(r["build_s"], 2),
        "warmup_s": round(r["warmup_s"], 2),
        "waited_for_lock_s": round(r.get("warmup_waited_s", 0.0), 2),
        "compiled_here": bool(r.get("warmup_cold", 0.0)),
        "step_s": round(r["step_s"], 2),
    }


def _drafter_spec(
    target_model: Path | None, layers: int, device: str, *, progress: Progress
) -> dict[str, Any]:
    """The drafter fields a WELCOME would carry for this target, with the run's default train settings."""
    from transformers import AutoConfig, AutoTokenizer

    from dflash_pipe.config.train import TrainConfig
    from dflash_pipe.drafter import DrafterConfig
    from dflash_pipe.target.gguf import resolve_target

    path = resolve_target(target_model)  # a GGUF file: its converted folder; TargetPathError (a ValueError)
    if path is None:
        from dflash_pipe.target import build_demo_target

        path = build_demo_target(progress=False)
    cfg = DrafterConfig.from_target(
        AutoConfig.from_pretrained(str(path)),
        tokenizer=AutoTokenizer.from_pretrained(str(path)),
        num_layers=layers,
        max_anchors=32 if device == "cpu" else 512,
    )
    train = TrainConfig()  # what a run compiles: full on CUDA, nothing on CPU (the layers, below)
    return {"drafter": cfg.to_dict(), "train": asdict(train), "target_path": str(path)}


def _start_together(spec: dict[str, Any], devices: list[str], cache: Path, folder: Path) -> list[dict]:
    """Starts one compile child per device at the same moment, all on ``cache``; their results."""
    specs = [{**spec, "device": device, "cache_dir": str(cache)} for device in devices]
    return start_children(folder, cache, "compile", specs).wait(timeout_s=CHILD_TIMEOUT_S)
