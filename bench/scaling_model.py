"""The paper model of issue 31 for its two cases: a 27B hybrid and a 1T MoE target on 64 nodes of 8 H200s,
1B training tokens. Prints the tables docs/scaling.md pastes; the arithmetic is `dflash_pipe.bench.scaling`.

Run:  python bench/scaling_model.py --out DIR        (CPU only, no torch; writes DIR/scaling_model.{md,json})

Every rate below names the recorded result it comes from (bench/results/...), or says PUBLIC (a published
figure, not measured here) or ASSUMED. Multi-node anything is an assumption: no run here had two nodes.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from dflash_pipe.bench.scaling import Case, Drafter, Gpu, Protocol, RunShape, Target, drafter_params, model

# ---------------------------------------------------------------------------------------------------------
# the two cases of issue 31

DRAFTER_27B_RATE = 4794.0
"""Trained tokens/s of the Qwen3.6-27B preset's drafter on one H200 at the launch defaults (budget 4,096,
samples to 3,072), weight update included: sum(tokens) / sum(seconds + update_seconds) over the 269 batches
of bench/results/h200_compile_sweep/steps_27b_from_230/compile_sweep.json (MFU 64.6% with the update)."""

HYBRID_16L_FEATURES = 43291.0
"""Feature tokens/s of the first 16 layers of the Qwen3.5-27B shape, packed, fla, compiled flex, one H200:
bench/results/h200_hybrid_target/hybrid_target.json (67.3% MFU). Scaled here by 16 / layers run."""

HYBRID_16L_DECODE = 3022.3
"""Generated tokens/s of the slot engine, the same 16-layer hybrid, batch 64, one H200:
bench/results/h200_decode_kernel_writes_auto_batch/decode_speed_hybrid.json. Scaled here by 16 / 64."""


def hybrid_27b() -> Case:
    """A 27B hybrid like Qwen3.6-27B (64 layers, H 5120, 3 of 4 layers Gated DeltaNet), bf16 on one GPU."""
    t = Target(
        name="27B hybrid (Qwen3.6-27B shape)",
        hidden=5120,
        layers=64,
        total_params=27e9,
        active_params=27e9,
        weight_bytes=2,
        feature_tokens_per_gpu_s=HYBRID_16L_FEATURES * 16 / 62,  # 62 = layers_run for 64 layers
        feature_source="bench/results/h200_hybrid_target/hybrid_target.json x 16/62 layers",
        decode_tokens_per_gpu_s=HYBRID_16L_DECODE * 16 / 64,
        decode_source="bench/results/h200_decode_kernel_writes_auto_batch/decode_speed_hybrid.json x 16/64",
    )
    d = Drafter(
        hidden=5120,
        heads=24,
        kv_heads=4,
        head_dim=256,
        ffn=17408,
        tokens_per_gpu_s=DRAFTER_27B_RATE,
        rate_source="bench/results/h200_compile_sweep/steps_27b_from_230/compile_sweep.json",
    )
    return Case(name="hybrid_27b", target=t, drafter=d)


def moe_1t() -> Case:
    """A 1T MoE like Kimi-K2 (DeepSeek-V3 layout: 61 layers, H 7168, MLA, 384 experts, 32.6B active), FP8
    weights as published. Nothing of it ran here: its rates are public serving figures of DeepSeek-V3
    (37B active) with expert parallelism, which the producer does not have."""
    t = Target(
        name="1T MoE (Kimi-K2 shape)",
        hidden=7168,
        layers=61,
        total_params=1.04e12,
        active_params=32.6e9,
        weight_bytes=1,
        feature_tokens_per_gpu_s=52300 / 8,
        feature_source="PUBLIC, not measured here: SGLang DeepSeek-V3 on 12x8 H100, 52.3K input tok/s per "
        "node (lmsys.org/blog/2025-05-05-large-scale-ep)",
        decode_tokens_per_gpu_s=22300 / 8,
        decode_source="PUBLIC, not measured here: same blog, 22.3K output tok/s per node",
    )
    # DrafterConfig.from_target on an MLA config: head_dim = v_head_dim (128), the target's 64 heads,
    # MLA_KV_HEADS = 8 KV heads, its dense intermediate_size 18432 (config/drafter.py)
    d = Drafter(
        hidden=7168,
        heads=64,
        kv_heads=8,
        head_dim=128,
        ffn=18432,
        tokens_per_gpu_s=0.0,
        rate_source="ASSUMED: the 27B drafter's measured rate x its parameters / these (same MFU)",
    )
    d27 = hybrid_27b().drafter
    rate = DRAFTER_27B_RATE * drafter_params(d27, 5) / drafter_params(d, 5)
    return Case(name="moe_1t", target=t, drafter=replace(d, tokens_per_gpu_s=rate))


# ---------------------------------------------------------------------------------------------------------
# where the model meets a measurement made here (one host each: nothing multi-node was ever measured)


def _one_gpu_time_sharing(per_token_s: list[float]) -> float:
    """The model's rate when every stage shares one GPU: each trained token costs the sum of its stages."""
    return 1.0 / sum(per_token_s)


def checks() -> list[dict]:
    """The model's arithmetic on set-ups that ran here, beside what they measured."""
    run = RunShape()
    return [
        {
            "what": "target + drafter time-sharing one H200 (1.7B shape), trained tokens/s",
            "model": _one_gpu_time_sharing([1 / 120566.6, 1 / 25421.5]),  # each stage alone, same file
            "measured": 21968.1,
            "source": "bench/results/h200_bench_throughput_compile_full/throughput.json",
        },
        {
            "what": "same GPU, regenerating (--responses target, 256 slots), trained tokens/s",
            "model": _one_gpu_time_sharing([run.generated_per_trained / 25300, 1 / 24300, 1 / 170000]),
            "measured": 10314.4,  # engine alone 25.3K, drafter alone 24.3K, features 170K: performance.md
            "source": "bench/results/h200_decode_kernel_writes_auto_batch/throughput_target_responses.json",
        },
        {
            "what": "2 drafter workers in lockstep (1.7B, 2 H200s), efficiency vs linear",
            "model": 0.938,  # lockstep on batch tokens, no all-reduce cost: cpu_batch_balance
            "measured": 21105.3 / (2 * 12155.6),
            "source": "bench/results/h200x2_scaling_drafters_preliminary/scaling-drafters.json",
        },
        {
            "what": "regroup after a SIGKILLed worker (gloo, CPU), seconds: keep-alive + last call",
            "model": Protocol().keep_alive_s + Protocol().last_call_s,
            "measured": 3.5,
            "source": "docs/reliability.md (tests/integration/test_elastic_cpu.py)",
        },
    ]


# ---------------------------------------------------------------------------------------------------------
# output


def _si(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def _num(digits: int):
    return lambda x: f"{x:.{digits}f}" if isinstance(x, float) else str(x)


_ROWS: list[tuple[str, tuple[str, ...], object]] = [
    ("split scope", ("split.scope",), str),
    ("GPUs per target replica", ("split.replica_gpus",), str),
    ("target / drafter GPUs (per node, or cluster)", ("split.target_gpus", "split.drafter_gpus"), str),
    (
        "target tokens/s per GPU: features / decoding",
        ("split.target_feature_tokens_per_gpu_s", "split.target_decode_tokens_per_gpu_s"),
        _num(0),
    ),
    (
        "supply per target GPU / demand per drafter GPU, trained tokens/s",
        ("split.supply_per_target_gpu", "split.demand_per_drafter_gpu"),
        _num(0),
    ),
    ("lockstep share (mean / max batch tokens)", ("split.lockstep_share",), _num(3)),
    ("balanced target share (continuous)", ("split.balanced_target_share",), _num(2)),
    ("target / drafter GPUs, whole run", ("split.target_gpus_total", "split.drafter_gpus_total"), str),
    (
        "supply / demand, tokens/s (per node, or cluster)",
        ("split.supply_tokens_s", "split.demand_tokens_s"),
        _si,
    ),
    ("trained tokens/s, whole run", ("split.cluster_trained_tokens_s",), _si),
    ("hours for the training tokens", ("hours_for_training_tokens",), _num(2)),
    ("feature bytes per token", ("links.feature_bytes_per_token",), lambda x: _si(x, "B")),
    (
        "features on a node's own link, per node",
        ("links.features_same_node_bytes_s_per_node",),
        lambda x: _si(x, "B/s"),
    ),
    (
        "features crossing nodes, per drafter node (ingress)",
        ("links.features_cross_node_bytes_s_per_node",),
        lambda x: _si(x, "B/s"),
    ),
    (
        "features crossing nodes, per target node (egress)",
        ("links.features_cross_node_egress_bytes_s_per_target_node",),
        lambda x: _si(x, "B/s"),
    ),
    ("drafter parameters", ("links.drafter_params",), _si),
    (
        "gradient all-reduce bytes per step per GPU",
        ("links.allreduce_bytes_per_step_per_gpu",),
        lambda x: _si(x, "B"),
    ),
    ("all-reduce s / step s", ("links.allreduce_s_per_step", "links.step_s"), _num(2)),
    (
        "gradient bytes/s per GPU (crosses nodes)",
        ("links.gradient_bytes_s_per_gpu",),
        lambda x: _si(x, "B/s"),
    ),
    (
        "messages/s per worker, out / in",
        ("coordinator.worker_msgs_s_out", "coordinator.worker_msgs_s_in"),
        _num(2),
    ),
    (
        "producers / workers per producer",
        ("coordinator.producers", "coordinator.workers_per_producer"),
        _num(1),
    ),
    (
        "messages/s per producer: with its workers / with the coordinator",
        ("coordinator.producer_msgs_s_with_workers", "coordinator.producer_msgs_s_with_coordinator"),
        _num(1),
    ),
    ("messages/s at the coordinator", ("coordinator.coordinator_msgs_s",), _num(0)),
    (
        "one silent host's stall / one cold start (compile), share of the run",
        ("silent_host_share_of_run", "cold_start_share_of_run"),
        _num(3),
    ),
    ("hand-over state (fp32 weights + AdamW), bytes", ("recovery.handover_state_bytes",), _si),
    ("recover from a killed node's processes, s", ("recovery.killed_process_s",), _num(1)),
    ("recover from a silent (lost) host, s", ("recovery.silent_host_s",), _num(1)),
    (
        "batches released by a lost node / s of the run to redo them",
        ("recovery.released_batches", "recovery.released_tokens_s_of_cluster"),
        _num(3),
    ),
    ("GPU-seconds stalled per killed node", ("recovery.stalled_gpu_s_killed",), _si),
]
_LEDGER_ROWS = [
    ("samples per epoch", "samples_per_epoch", str),
    ("in memory, bytes", "memory_bytes", _si),
    ("in a checkpoint / hand-over, bytes", "serialized_bytes", _si),
    ("sample-id all-gather per step per rank, bytes", "ids_allgather_bytes_per_step_per_rank", str),
]


def _get(tree: dict, path: str):
    for key in path.split("."):
        tree = tree[key]
    return tree


def markdown(results: list[dict]) -> str:
    """One column per case and responses mode; the ledger and the run's length below."""
    cols = [(r, mode) for r in results for mode in ("dataset", "target")]
    lines = ["| figure | " + " | ".join(f"{r['case']}, {m} responses" for r, m in cols) + " |"]
    lines.append("| --- |" + " ---: |" * len(cols))
    for name, paths, fmt in _ROWS:
        cells = [" / ".join(fmt(_get(r[m], p)) for p in paths) for r, m in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| ledger | " + " | ".join(r["case"] for r in results) + " |",
        "| --- |" + " ---: |" * len(results),
    ]
    for name, key, fmt in _LEDGER_ROWS:
        lines.append(f"| {name} | " + " | ".join(fmt(r["ledger"][key]) for r in results) + " |")
    hours = " | ".join(f"{r['hours_regen_then_dataset']:.2f}" for r in results)
    lines.append(f"| hours: epoch 0 regenerating, then the dataset split | {hours} |")
    return "\n".join(lines) + "\n"


def checks_markdown(checked: list[dict]) -> str:
    lines = ["| checked here | model | measured | ratio | file |", "| --- | ---: | ---: | ---: | --- |"]
    for c in checked:
        ratio = c["measured"] / c["model"]
        model, measured = (f"{x:,.0f}" if x >= 100 else f"{x:.3f}" for x in (c["model"], c["measured"]))
        lines.append(f"| {c['what']} | {model} | {measured} | {ratio:.2f} | `{c['source']}` |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = RunShape()
    ap.add_argument(
        "--out", type=Path, default=None, help="write scaling_model.md and scaling_model.json here"
    )
    ap.add_argument("--nodes", type=int, default=defaults.nodes)
    ap.add_argument("--gpus-per-node", type=int, default=defaults.gpus_per_node)
    ap.add_argument("--training-tokens", type=float, default=defaults.training_tokens)
    ap.add_argument("--epochs", type=int, default=defaults.epochs)
    ap.add_argument(
        "--busbw-gb-s",
        type=float,
        default=Gpu().internode_busbw_gb_s,
        help="all-reduce bus bandwidth per GPU",
    )
    args = ap.parse_args(argv)
    run = RunShape(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        training_tokens=args.training_tokens,
        epochs=args.epochs,
    )
    gpu = Gpu(internode_busbw_gb_s=args.busbw_gb_s)
    results = [model(replace(case(), run=run, gpu=gpu)) for case in (hybrid_27b, moe_1t)]
    checked = checks()
    text = markdown(results) + "\n" + checks_markdown(checked)
    print(text, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "scaling_model.md").write_text(text)
        (args.out / "scaling_model.json").write_text(
            json.dumps({"cases": results, "checks": checked}, indent=1) + "\n"
        )
    return results


if __name__ == "__main__":
    main()
