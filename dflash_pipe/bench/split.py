"""`dflash-pipe bench split`: how many of a node's GPUs should run the target and how many the drafters.

The probe measures, on the run's real target, drafter and data, one target replica alone (trained tokens/s
of features it supplies per GPU) and one drafter alone (tokens/s it trains per GPU), a few seconds each,
with the same stages `bench throughput` uses. With ``--responses target`` the replica also regenerates:
its supply per GPU is then 1 / (1/feature rate + g/decode rate), g = generated tokens per trained token
(the data's assistant share; the decode rate measured on a few of its conversations). Every split of N
GPUs gives min(t x supply, (N - t) x demand); the best is picked (ties: fewer target GPUs). On one GPU
both share the device: the probe then says the share of its time each side needs, and the time-sharing
bound 1 / (1/supply + 1/demand).

Demand per drafter GPU is measured on one drafter: lockstep and the all-reduce make each of N a little
slower (docs/scaling.md, the lockstep share), so the pick leans to drafters; ``--verify`` runs the real
pipeline at the pick and its two neighbours and says whether the pick was within 5% of the best of them.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from dflash_pipe.bench.result import BenchResult
from dflash_pipe.bench.save import goal
from dflash_pipe.run.config import RunConfig
from dflash_pipe.run.split import Split, neighbours, shared_device, splits, supply_with_regeneration

PICK_GOAL = 0.95
"""Issue 31: the picked split's measured tokens/s within 5% of the best measured neighbour."""


def probe_config(cfg: RunConfig, gpus: tuple[int, ...]) -> RunConfig:
    """One target replica and one drafter: on two GPUs of ``gpus`` when there are two, else sharing one;
    on CPU, the CPU with one drafter worker."""
    if cfg.layout.device == "cpu":
        return dataclasses.replace(cfg, layout=dataclasses.replace(cfg.layout, cpu_workers=1))
    pair = (gpus[0],), (gpus[1] if len(gpus) > 1 else gpus[0],)
    return dataclasses.replace(
        cfg, layout=dataclasses.replace(cfg.layout, target_gpus=pair[0], drafter_gpus=pair[1])
    )


def split_layout(cfg: RunConfig, gpus: tuple[int, ...], split: Split) -> RunConfig:
    layout = dataclasses.replace(
        cfg.layout, target_gpus=gpus[: split.target], drafter_gpus=gpus[split.target :]
    )
    return dataclasses.replace(cfg, layout=layout)


def run_split_bench(
    cfg: RunConfig,
    *,
    gpus: tuple[int, ...],
    seconds: float,
    work_dir: Path,
    verify: bool,
    progress: Any = None,
) -> BenchResult:
    """The probe (and with ``verify`` the pipeline at the pick and its neighbours) as a bench result."""
    from dflash_pipe.bench.stages import drafters_alone, prepare_work, producer_alone
    from dflash_pipe.bench.throughput import bench_run_config, run_pipeline

    say = progress or (lambda _text: None)
    regenerate = cfg.data.responses == "target"
    base = bench_run_config(cfg, Path(work_dir))
    say("loading target config, tokenizer and data")
    work = prepare_work(probe_config(base, gpus))
    say(f"one target replica alone ({seconds:g} s)")
    feature_rate = producer_alone(work, seconds).tokens_per_s
    say(f"one drafter alone ({seconds:g} s after its first step)")
    demand = drafters_alone(work, seconds).tokens_per_s
    supply, regen = feature_rate, {}
    if regenerate:
        say("one replica regenerating a few conversations")
        regen = decode_probe(cfg, work, Path(work_dir) / "regen")
        supply = supply_with_regeneration(
            feature_rate, regen["decode_tokens_per_s"], regen["generated_per_trained"]
        )
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {
        "target_tokens_per_s_per_gpu": round(supply, 1),
        "feature_tokens_per_s_per_gpu": round(feature_rate, 1),
        "drafter_tokens_per_s_per_gpu": round(demand, 1),
        **regen,
    }
    if len(gpus) < 2:
        shared = shared_device(supply, demand)
        summary.update({k: round(v, 3) for k, v in shared.items()})
        summary["pick"] = "shared"
        summary["why"] = (
            f"one device: the target needs {shared['target_share']:.0%} of its time and the drafters "
            f"{shared['drafter_share']:.0%}; the best the pipeline can do is {shared['predicted_tokens_per_s']:.0f} "
            "tokens/s"
        )
        rows.append({"split": "shared", "predicted_tokens_per_s": round(shared["predicted_tokens_per_s"], 1)})
        if cfg.layout.device == "cpu":
            summary["note"] = (
                "CPU: each side alone ran with a launch's per-process thread count, so it may not have kept "
                "every core busy; the prediction is then conservative and the pipeline can beat it"
            )
        if verify:
            say(f"pipeline on the shared device ({seconds:g} s)")
            rate, _ = run_pipeline(
                work, seconds, shared["predicted_tokens_per_s"], mode=None, responses=cfg.data.responses
            )
            rows[0]["measured_tokens_per_s"] = round(rate.tokens_per_s, 1)
            ratio = rate.tokens_per_s / shared["predicted_tokens_per_s"]
            summary["measured_vs_predicted"] = round(ratio, 3)
    else:
        ranked = splits(len(gpus), supply, demand)
        pick = ranked[0]
        summary["pick"] = pick.label
        summary["why"] = (
            f"{pick.target} target GPU(s) supply {pick.supply:.0f} tokens/s and {pick.drafters} drafter GPU(s) "
            f"train {pick.demand:.0f}: the most any split of {len(gpus)} trains"
        )
        for split in ranked:
            rows.append(
                {
                    "split": split.label,
                    "supply_tokens_per_s": round(split.supply, 1),
                    "demand_tokens_per_s": round(split.demand, 1),
                    "predicted_tokens_per_s": round(split.predicted, 1),
                    "picked": split is pick,
                }
            )
        if verify:
            measured = {}
            for split in neighbours(ranked):
                say(f"pipeline at {split.label} ({seconds:g} s)")
                work_at = dataclasses.replace(work, cfg=split_layout(work.cfg, gpus, split))
                measured[split.label] = run_pipeline(work_at, seconds, split.predicted, mode=None)[
                    0
                ].tokens_per_s
            for row in rows:
                if row["split"] in measured:
                    row["measured_tokens_per_s"] = round(measured[row["split"]], 1)
            best = max(measured.values())
            ratio = measured[pick.label] / best if best > 0 else None
            summary["pick_vs_best_measured"] = None if ratio is None else round(ratio, 3)
            summary["goals"] = [
                goal(
                    "pick within 5% of the best neighbour",
                    summary["pick_vs_best_measured"],
                    at_least=PICK_GOAL,
                )
            ]
    config = {
        "target_model": str(cfg.target_model) if cfg.target_model else "demo",
        "device": cfg.layout.device,
        "gpus": list(gpus),
        "seconds": seconds,
        "responses": cfg.data.responses,
        "data": str(cfg.data.path),
        "token_budget": cfg.data.token_budget,
        "verify": verify,
    }
    chart = {"x": "split", "y": "predicted_tokens_per_s", "kind": "bar", "title": "trained tokens/s by split"}
    return BenchResult(name="split", config=config, rows=rows, summary=summary, chart=chart)


def decode_probe(cfg: RunConfig, work: Any, out_dir: Path) -> dict[str, float]:
    """Generated tokens/s of one replica in steady state: the producer's generator (``TurnGenerator``, the
    slot engine where it serves the target) warms up on one batch of the data's conversations, then the
    next two batches are timed. And the data's generated-per-trained share (its assistant tokens over all
    its tokens): the target's replies are assumed as long as the dataset's."""
    from transformers import AutoTokenizer

    from dflash_pipe.data.conversations import load_conversations
    from dflash_pipe.data.regenerated import RegenTally
    from dflash_pipe.regenerate import load_model
    from dflash_pipe.target.generate import TurnGenerator

    if not Path(cfg.data.path).is_file():
        raise ValueError(
            f"--data {cfg.data.path}: the split probe with --responses target reads conversations from a JSONL "
            "file; give one (the run itself may read any source launch takes)"
        )
    device = work.cfg.layout.target_devices()[0]
    generator = TurnGenerator(
        load_model(work.ctx.target_path, device),
        AutoTokenizer.from_pretrained(str(work.ctx.target_path)),
        cfg.regen,
        device=device,
        max_length=cfg.data.max_length,
        template_kwargs=cfg.data.chat_template_kwargs,
    )
    batch = generator.batch_size
    out_dir.mkdir(parents=True, exist_ok=True)
    source = out_dir / "probe.jsonl"
    with open(cfg.data.path) as f:
        source.write_text("".join(line for _, line in zip(range(3 * batch), f, strict=False)))
    conversations = load_conversations(
        dataclasses.replace(cfg.data, path=source), spill_dir=out_dir
    ).conversations
    warm, timed = conversations[:batch], conversations[batch:]
    if not timed:
        raise ValueError(
            f"--data {cfg.data.path}: fewer than {batch + 1} conversations to probe the decode rate"
        )
    generator.regenerate(list(enumerate(warm)), on_done=lambda _record: None)
    tally = RegenTally()
    t0 = time.perf_counter()
    generator.regenerate([(batch + i, c) for i, c in enumerate(timed)], on_done=tally.add)
    seconds = time.perf_counter() - t0
    del generator  # its model and slot cache, before the pipeline that --verify launches
    _free_gpu_memory()
    samples = work.ctx.train_samples
    trained = sum(int(s.loss_mask.sum()) for s in samples)
    total = sum(int(s.input_ids.numel()) for s in samples)
    return {
        "decode_tokens_per_s": round(tally.new_tokens / seconds, 1) if seconds > 0 else 0.0,
        "decode_batch": float(batch),
        "generated_per_trained": round(trained / total, 3) if total else 0.0,
    }


def _free_gpu_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
