"""`dflash-pipe bench throughput`: each stage alone and the whole pipeline, on the same data, in one run.

Stages (tokens/s of the run's real samples, batched by the run's own plans):
  producer alone   target forward over the batches, features dropped
  drafters alone   the real training loop on synthetic features of the right shape (no target, no wire)
  transport alone  BATCH messages of the right size through the real wire to worker processes
  pipeline         a real `dflash-pipe launch` (producer + worker processes), bounded in steps
With ``compare``: offline (features written to safetensors files, then read back for training, end to end)
and the drafters as threads of one worker process (``layout.drafter_mode = "threads"``). With ``responses =
"target"``: the pipeline again, its target regenerating every assistant turn while the drafters train
(``--responses target``), beside the run on the dataset's responses: trained tokens/s and launch to first
step of each.

Pipeline efficiency = pipeline / the slowest stage alone (goal >= 0.95). When the target and the drafters
share devices (CPU, or the same GPUs), each stage alone had them to itself, so the best a pipeline can do is
the time-sharing bound 1 / (1/producer alone + 1/drafters alone); the goal is then checked against that
bound (the plain efficiency is still reported). Where the time went comes from the producer's own counters
(idle target share, starved worker share, ready-queue depth).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_pipe.bench.child import MIN_MEASURED_STEPS
from dflash_pipe.bench.result import BenchResult
from dflash_pipe.bench.save import goal
from dflash_pipe.bench.stages import (
    BenchWork,
    StageRate,
    drafters_alone,
    drafters_on,
    lockstep_rate,
    prepare_work,
    producer_alone,
    transport_alone,
    write_batch_files,
)
from dflash_pipe.run.config import RunConfig
from dflash_pipe.run.dir import RunDir
from dflash_pipe.run.layout import LayoutConfig

EFFICIENCY_GOAL = 0.95
REGEN_RATE_GOAL = 0.5
"""Issue 30: trained tokens/s with regeneration running, at least this share of the dataset-response run's."""
REGEN_FIRST_STEP_GOAL = 1.2
"""Issue 30: launch to first step with regeneration, at most this multiple of the dataset-response run's."""
TARGET_RESPONSES = "pipeline (target responses)"
STAGES = ("producer alone", "drafters alone", "transport alone")
Progress = Callable[[str], None]


def bench_run_config(cfg: RunConfig, work_dir: Path) -> RunConfig:
    """The user's run config, pointed at a scratch run dir: no eval (simulated or real), no checkpoint but
    the final one, and the data's own responses (the stages measured here are the feature path; with
    ``--responses target`` the pipeline runs once more regenerating, ``run_pipeline(responses=...)``)."""
    return dataclasses.replace(
        cfg,
        run_dir=work_dir / "prepare",
        eval_samples=0,
        compile_cache=RunDir(work_dir).compile_cache,
        data=dataclasses.replace(cfg.data, responses="dataset"),
        train=dataclasses.replace(
            cfg.train, checkpoint_every=10**9, eval_every=0, eval_generate="off", log_every=1, max_steps=None
        ),
    )


def run_throughput_bench(
    cfg: RunConfig,
    *,
    seconds: float,
    work_dir: Path,
    compare: bool = False,
    progress: Progress | None = None,
) -> BenchResult:
    """Measures every stage for about ``seconds`` each (plus start-up), then the pipeline (twice when
    ``cfg.data.responses`` is "target": on the dataset's responses and regenerating the target's)."""
    say = progress or (lambda _text: None)
    regenerate = cfg.data.responses == "target"
    cfg = bench_run_config(cfg, Path(work_dir))
    say("loading target config, tokenizer and data")
    work = prepare_work(cfg)
    rates: dict[str, StageRate] = {}
    say(f"producer alone ({seconds:g} s)")
    rates["producer alone"] = producer_alone(work, seconds)
    say(f"drafters alone ({seconds:g} s after each worker's first step)")
    rates["drafters alone"] = drafters_alone(work, seconds)
    say(f"transport alone ({seconds:g} s)")
    rates["transport alone"] = transport_alone(work, seconds)
    slowest = min(STAGES, key=lambda s: rates[s].tokens_per_s)
    say(f"pipeline: dflash-pipe launch for about {seconds:g} s of training")
    pipeline, waits = run_pipeline(work, seconds, rates[slowest].tokens_per_s, mode=None)
    rates["pipeline"] = pipeline
    if regenerate:
        say("pipeline again, the target regenerating every assistant turn (--responses target)")
        rates[TARGET_RESPONSES], _ = run_pipeline(
            work, seconds, rates[slowest].tokens_per_s, mode=None, responses="target"
        )
    if compare:
        say("offline: features to safetensors files, then training reads them back")
        rates["offline (disk)"] = offline(work, pipeline.tokens)
        say("threads: every drafter a thread of one worker process (--drafter-mode threads)")
        rates["threads"], _ = run_pipeline(work, seconds, rates[slowest].tokens_per_s, mode="threads")
    return _result(work, rates, waits, slowest, seconds=seconds, compare=compare)


def run_pipeline(
    work: BenchWork, seconds: float, bottleneck_rate: float, *, mode: str | None, responses: str = "dataset"
) -> tuple[StageRate, dict[str, float]]:
    """A real launch (producer here, worker processes) bounded to about ``seconds`` of training by
    ``max_steps``, sized from the slowest stage's rate; its rate is acked tokens between first and last ACK.
    ``responses`` "target": the same run with the target regenerating the data's replies as it trains (the
    same steps, so the two rates and first steps compare)."""
    from rich.console import Console

    from dflash_pipe.launcher import launch

    workers = work.cfg.layout.num_workers
    per_step = workers * work.mean_batch_tokens()
    # At least twice the producer's look-ahead (ready batches + one per replica) through the window.
    buffered = work.cfg.wire.ready_batches + len(work.cfg.layout.target_devices())
    steps = max(
        MIN_MEASURED_STEPS + 1,
        math.ceil(2 * buffered / workers) + 1,
        math.ceil(seconds * bottleneck_rate / per_step) + 1,
    )
    epochs = math.ceil(steps * workers / len(work.plans)) + 1
    name = "pipeline" if mode is None else f"pipeline-{mode}"
    name += "-target-responses" if responses == "target" else ""
    layout = work.cfg.layout if mode is None else dataclasses.replace(work.cfg.layout, drafter_mode=mode)
    cfg = dataclasses.replace(
        work.cfg,
        run_dir=work.work_dir.parent / name,
        layout=layout,
        data=dataclasses.replace(work.cfg.data, responses=responses),
        train=dataclasses.replace(work.cfg.train, max_steps=steps, epochs=max(epochs, work.cfg.train.epochs)),
    )
    quiet = Console(file=io.StringIO())
    launched = time.time()
    summary = launch(cfg, resume=False, console=quiet, live=False)
    stage = "pipeline" if mode is None else mode
    stage = TARGET_RESPONSES if responses == "target" else stage
    # Sustained = min(trained, produced) in the window: the ready queue filled during start-up can feed
    # the workers faster than the target for a while, and must not count as pipeline throughput.
    sustained = min(summary.ack_window_tokens, summary.produced_window_tokens)
    extra = {
        "steps": summary.steps,
        "trained_tokens": summary.ack_window_tokens,
        "produced_tokens": summary.produced_window_tokens,
        "launch_to_first_step_s": first_step_s(cfg.run_dir, launched),
        "run_dir": str(cfg.run_dir),
    }
    if summary.regen:
        extra["generated_tokens"] = summary.regen["new_tokens"]
        extra["conversations_generated"] = summary.regen["conversations_generated"]
        extra["regen_seconds"] = round(summary.regen["seconds"], 3)
        busy = summary.waits.get("target_busy_s", 0.0)
        share = summary.waits.get("target_generate_s", 0.0) / busy if busy > 0 else None
        extra["target_generating_share"] = None if share is None else round(share, 3)
        extra["drafters_idle_share"] = round(summary.waits.get("workers_starved_share", 0.0), 3)
    return StageRate(stage, sustained, summary.ack_window_s, extra), summary.waits


def first_step_s(run_dir: Path, launched: float) -> float | None:
    """Seconds from ``launched`` (``time.time()`` before the launch) to the first trained step's metrics
    record in the run's ``metrics.jsonl`` (the bench logs every step); None when no step was logged."""
    path = RunDir(run_dir).metrics
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            return round(record["time"] - launched, 3)
    return None


def offline(work: BenchWork, tokens: int) -> StageRate:
    """An offline trainer on the same work (the pipeline's trained tokens): the target writes each batch's
    features to a safetensors file, then the drafters train on exactly those files, read back from disk.
    The rate is all those tokens over write time + training time (start-up and first steps left out)."""
    out = work.work_dir / "offline-batches"
    workers = work.cfg.layout.num_workers
    written = write_batch_files(
        work, out, features=True, max_tokens=tokens, min_batches=(MIN_MEASURED_STEPS + 1) * workers
    )
    results = drafters_on(work, out, seconds=None, synthetic=False)
    train = lockstep_rate("offline training", results)
    trained = sum(r["tokens_total"] for r in results)
    # Each worker's first step (compile, warm-up) is left out, as in the other stages: the training time
    # of all the written tokens at the rate after the first step.
    train_s = trained / train.tokens_per_s if train.tokens_per_s > 0 else float("inf")
    extra = {
        "write_s": round(written["seconds"], 3),
        "train_s": round(train_s, 3),
        "disk_bytes": written["bytes"],
        "train_tokens_per_s": round(train.tokens_per_s, 1),
    }
    return StageRate("offline (disk)", trained, written["seconds"] + train_s, extra)


def _result(
    work: BenchWork,
    rates: dict[str, StageRate],
    waits: dict[str, float],
    slowest: str,
    *,
    seconds: float,
    compare: bool,
) -> BenchResult:
    pipeline = rates["pipeline"].tokens_per_s
    rows = []
    for r in rates.values():
        rows.append(
            {
                "stage": r.stage,
                "tokens": r.tokens,
                "seconds": round(r.seconds, 3),
                "tokens_per_s": round(r.tokens_per_s, 1),
                "vs_pipeline": round(r.tokens_per_s / pipeline, 3) if pipeline > 0 else None,
                "detail": {k: v for k, v in r.extra.items() if k != "run_dir"},
            }
        )
    summary = summarize(rates, waits, slowest, work.cfg.layout)
    d = work.ctx.drafter
    config = {
        "target_model": str(work.cfg.target_model) if work.cfg.target_model else "demo",
        "device": work.cfg.layout.device,
        "target_devices": work.cfg.layout.target_devices(),
        "worker_devices": work.cfg.layout.worker_devices(),
        "seconds": seconds,
        "compare": compare,
        "data": str(work.cfg.data.path),
        "token_budget": work.cfg.data.token_budget,
        "max_length": work.cfg.data.max_length,
        "batches_per_epoch": len(work.plans),
        "mean_batch_tokens": round(work.mean_batch_tokens(), 1),
        "drafter": {"layers": d.num_hidden_layers, "hidden": d.hidden_size, "feature_size": d.feature_size},
        "max_anchors": d.max_anchors,
        "feature_dtype": str(work.feature_dtype).removeprefix("torch."),
        "compile": work.cfg.train.compile,
        "responses": "dataset and target" if TARGET_RESPONSES in rates else "dataset",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if TARGET_RESPONSES in rates:
        regen = work.cfg.regen
        config["regen"] = {"max_new_tokens": regen.max_new_tokens, "batch_size": regen.batch_size}
        config["regen"] |= {"decoder": regen.decoder, "temperature": regen.temperature}
    chart = {"x": "stage", "y": "tokens_per_s", "kind": "bar", "title": "tokens/s by stage (same data)"}
    return BenchResult(name="throughput", config=config, rows=rows, summary=summary, chart=chart)


def shared_devices(layout: LayoutConfig) -> str | None:
    """What the target and the drafters share in a launch with this layout (None: nothing)."""
    if layout.device == "cpu":
        return "the CPU cores"
    shared = layout.shared_gpus()
    return f"GPU(s) {shared}" if shared else None


def shared_device_bound(producer_alone: float, drafters_alone: float) -> float:
    """Best pipeline tokens/s when the target and the drafters time-share the same devices: every token
    costs its producer time plus its drafter time, so 1 / (1/producer_alone + 1/drafters_alone)."""
    if producer_alone <= 0 or drafters_alone <= 0:
        return 0.0
    return 1.0 / (1.0 / producer_alone + 1.0 / drafters_alone)


def summarize(
    rates: dict[str, StageRate], waits: dict[str, float], slowest: str, layout: LayoutConfig
) -> dict[str, Any]:
    """Efficiency against the slowest stage alone, the time-sharing bound when the target and the drafters
    share devices (the goal is then checked against that bound), the comparisons and where time went."""
    pipeline = rates["pipeline"].tokens_per_s
    efficiency = pipeline / rates[slowest].tokens_per_s if rates[slowest].tokens_per_s > 0 else None
    summary: dict[str, Any] = {
        "slowest_stage": slowest,
        "pipeline_efficiency": None if efficiency is None else round(efficiency, 3),
    }
    notes = []
    goal_name, goal_value = "pipeline efficiency", summary["pipeline_efficiency"]
    shared = shared_devices(layout)
    if shared is not None:
        bound = shared_device_bound(
            rates["producer alone"].tokens_per_s, rates["drafters alone"].tokens_per_s
        )
        vs_bound = round(pipeline / bound, 3) if bound > 0 else None
        summary["shared_device_bound_tokens_per_s"] = round(bound, 1)
        summary["pipeline_vs_shared_bound"] = vs_bound
        goal_name, goal_value = "pipeline vs shared-device bound", vs_bound
        notes.append(
            f"the target and the drafters share {shared}: each stage alone had them to itself, so the "
            "pipeline cannot reach the slowest stage alone; its best is the time-sharing bound "
            "1 / (1/producer_alone + 1/drafters_alone) (each token costs target time plus drafter time on "
            "the same devices), and the goal is checked against that bound (pipeline_vs_shared_bound); "
            "pipeline_efficiency (against the slowest stage alone) includes the sharing"
        )
        if layout.device == "cpu":
            notes.append(
                "CPU: each stage alone ran with a launch's per-process thread count, so it may not have "
                "kept every core busy; the bound is then conservative and the ratio can exceed 1"
            )
        elif set(layout.target_gpus) != set(layout.drafter_gpus):
            notes.append(
                "only some GPUs are shared: the bound assumes all are, so it is below this layout's best"
            )
    summary["where_time_went"] = {k: round(v, 3) for k, v in waits.items()}
    for other in ("offline (disk)", "threads"):
        if other in rates and rates[other].tokens_per_s > 0:
            summary[f"pipeline_vs_{other.split()[0]}"] = round(pipeline / rates[other].tokens_per_s, 3)
    summary["goals"] = [goal(goal_name, goal_value, at_least=EFFICIENCY_GOAL)]
    if TARGET_RESPONSES in rates:
        summary["responses"], goals = responses_comparison(rates["pipeline"], rates[TARGET_RESPONSES])
        summary["goals"] += goals
    summary["notes"] = notes + [
        "target idle share: the target had nothing to compute (ready queue full, waiting for credits); "
        "workers starved share: workers held credits the producer could not fill (waiting for batches)"
    ]
    return summary


def responses_comparison(dataset: StageRate, target: StageRate) -> tuple[dict[str, Any], list[dict]]:
    """The pipeline on the target's regenerated responses against the same run on the dataset's: trained
    tokens/s and launch to first step of each, their ratios, and issue 30's goals on both ratios."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    first = {
        r: rate.extra.get("launch_to_first_step_s") for r, rate in (("dataset", dataset), ("target", target))
    }
    out = {
        "dataset": {
            "tokens_per_s": round(dataset.tokens_per_s, 1),
            "launch_to_first_step_s": first["dataset"],
        },
        "target": {
            "tokens_per_s": round(target.tokens_per_s, 1),
            "launch_to_first_step_s": first["target"],
            "generated_tokens": target.extra.get("generated_tokens"),
        },
        "target_vs_dataset_tokens_per_s": ratio(target.tokens_per_s, dataset.tokens_per_s),
        "target_vs_dataset_first_step": ratio(first["target"], first["dataset"]),
    }
    goals = [
        goal("trained tokens/s, target vs dataset responses", out["target_vs_dataset_tokens_per_s"],
             at_least=REGEN_RATE_GOAL),
        goal("launch to first step, target vs dataset responses", out["target_vs_dataset_first_step"],
             at_most=REGEN_FIRST_STEP_GOAL),
    ]  # fmt: skip
    return out, goals
