"""`dflash-pipe bench compile`: time to first training step on a cold cache, a warm one, and N together.

Each case starts fresh worker processes (``python -m dflash_pipe.bench.child compile``) with the launcher's
worker environment (one shared TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR, bounded compile threads), which
build the drafter, run the worker's warm-up (``train.warmup.warm_up``: one process compiles under the
cache's lock, the others wait and start warm) and then one real training step. The figure is wall time
from the process's start to the end of that step.

  cold      one worker on an empty cache
  warm      one worker on the cache the cold one left
  together  N workers started at once on another empty cache, as `launch` starts them

Goal: the slowest of the N together within 1.2x of one worker's cold time. On CPU a worker compiles
nothing (flex attention has no CPU backward, so the CPU path is eager SDPA), so the bench compiles the
drafter's decoder layers (``torch.compile(dynamic=True)``) to measure a real compile, and says so.
"""

from __future__ import annotations

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
Progress = Callable[[str], None]


def run_compile_bench(
    *,
    target_model: Path | None,
    device: str,
    gpus: tuple[int, ...] = (0,),
    workers: int = 2,
    draft_layers: int | None = None,
    seq_len: int | None = None,
    work_dir: Path,
    progress: Progress | None = None,
) -> BenchResult:
    say = progress or (lambda _text: None)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}.")
    work_dir = Path(work_dir)
    cpu = device == "cpu"
    layers = draft_layers or (1 if cpu else 5)
    length = seq_len or (256 if cpu else 2048)
    say("resolving the target and the drafter shape")
    spec = _drafter_spec(target_model, layers, device, progress=say)
    spec.update(compile_layers=cpu, step_seq_len=length, warmup_seq_len=length)
    devices = ["cpu"] * workers if cpu else [f"cuda:{gpus[i % len(gpus)]}" for i in range(workers)]
    rows: list[dict[str, Any]] = []
    cache = work_dir / "cache-single"
    say("cold: one worker, empty cache")
    cold = _start_together(spec, devices[:1], cache, work_dir / "cold")[0]
    rows.append(_row("cold", 1, cold))
    say("warm: one worker, the cache the cold one filled")
    warm = _start_together(spec, devices[:1], cache, work_dir / "warm")[0]
    rows.append(_row("warm", 1, warm))
    say(f"together: {workers} workers at once on an empty cache")
    together = _start_together(spec, devices, work_dir / "cache-together", work_dir / "together")
    for i, r in enumerate(together):
        rows.append(_row(f"together #{i}", workers, r))
    slowest = max(r["first_step_s"] for r in together)
    ratio = slowest / cold["first_step_s"]
    notes = []
    if cpu:
        notes.append(
            "CPU: a CPU worker compiles nothing (eager SDPA); this bench compiles the drafter's decoder "
            "layers with torch.compile(dynamic=True) so that it measures a real Inductor compile"
        )
    summary = {
        "cold_s": round(cold["first_step_s"], 2),
        "warm_s": round(warm["first_step_s"], 2),
        "together_slowest_s": round(slowest, 2),
        "together_vs_cold": round(ratio, 3),
        "warm_vs_cold": round(warm["first_step_s"] / cold["first_step_s"], 3),
        "goals": [goal(f"{workers} together / one cold", round(ratio, 3), at_most=TOGETHER_GOAL)],
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
        "compiled": "drafter decoder layers (bench, CPU)"
        if cpu
        else "flex attention + block mask (as a run)",
    }
    chart = {"x": "case", "y": "first_step_s", "kind": "bar", "title": "time to first step (s)"}
    return BenchResult(name="compile", config=config, rows=rows, summary=summary, chart=chart)


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

    from dflash_pipe.drafter import DrafterConfig
    from dflash_pipe.train.config import TrainConfig

    path = target_model
    if path is None:
        from dflash_pipe.target import build_demo_target

        path = build_demo_target(progress=False)
    if not (Path(path) / "config.json").exists():
        raise FileNotFoundError(
            f"--target-model {path}: no config.json there; pass a Hugging Face model directory."
        )
    cfg = DrafterConfig.from_target(
        AutoConfig.from_pretrained(str(path)),
        tokenizer=AutoTokenizer.from_pretrained(str(path)),
        num_layers=layers,
        max_anchors=32 if device == "cpu" else 512,
    )
    train = TrainConfig(compile="on" if device == "cuda" else "off")
    return {"drafter": cfg.to_dict(), "train": asdict(train), "target_path": str(path)}


def _start_together(spec: dict[str, Any], devices: list[str], cache: Path, folder: Path) -> list[dict]:
    """Starts one compile child per device at the same moment, all on ``cache``; their results."""
    specs = [{**spec, "device": device, "cache_dir": str(cache)} for device in devices]
    return start_children(folder, cache, "compile", specs).wait(timeout_s=CHILD_TIMEOUT_S)
