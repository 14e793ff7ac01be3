"""A paper model of one dflash-pipe run on many nodes: GPUs per side, bytes per link, coordinator load,
the ledger's size and the time to recover a lost node (issue 31, docs/scaling.md).

The inputs are dataclasses; `bench/scaling_model.py` fills them for the two cases of issue 31 (a 27B hybrid
and a 1T MoE target) from the recorded results and prints the tables. No torch, no GPU: plain arithmetic.

Nothing here is measured: every rate is a figure recorded in this repository (the file is named next to
the constant) or, where nothing was recorded, a public figure or an assumption that says so. Multi-node
anything is an assumption: no run here ever had two nodes, and producers cannot attach from another node
yet (issue 31's first item). The arithmetic is kept in small named functions so a reader (and
tests/bench/test_scaling_model.py) can redo each figure by hand.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, slots=True)
class Gpu:
    """One accelerator. H200 SXM figures from NVIDIA's data sheet unless a source says otherwise."""

    name: str = "H200"
    peak_bf16_tflops: float = 989.0  # dense bf16 (data sheet); the repo's MFU figures use 790, measured
    hbm_tb_s: float = 4.8
    memory_gb: float = 141.0
    usable_memory_share: float = 0.85  # assumed: what weights may take, the rest for activations / KV
    internode_busbw_gb_s: float = 45.0  # assumed: NCCL all-reduce bus bandwidth per GPU over one 400 Gb/s NIC
    # per GPU at ~90%; NOT measured (no multi-node machine was ever lent)


@dataclass(frozen=True, slots=True)
class Target:
    """The frozen target: its shape and the rates one GPU reaches on it (tokens/s per GPU)."""

    name: str
    hidden: int
    layers: int
    total_params: float
    active_params: float
    weight_bytes: float  # bytes per weight as served (2 bf16, 1 fp8)
    feature_tokens_per_gpu_s: float  # feature forward (prefill) tokens/s per GPU
    feature_source: str
    decode_tokens_per_gpu_s: float  # generated tokens/s per GPU (regeneration, --responses target)
    decode_source: str
    feature_layers: int = 5  # DESIGN.md: as many as the drafter has layers
    feature_bytes: int = 2  # bf16 on the wire (--wire-dtype bf16, the default)


@dataclass(frozen=True, slots=True)
class Drafter:
    """The drafter trained against the target: its shape (for its parameter count) and its rate."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tokens_per_gpu_s: float  # trained tokens/s per GPU, one worker alone, weight update included
    rate_source: str
    layers: int = 5


@dataclass(frozen=True, slots=True)
class Protocol:
    """The run's wire and group constants, as the code has them today."""

    heartbeat_s: float = 2.0  # run/config.py WireConfig.heartbeat_s
    peer_timeout_s: float = 120.0  # run/config.py WireConfig.peer_timeout_s (also the collective timeout)
    worker_credits: int = 2  # run/config.py WireConfig.worker_credits: batches leased to a worker at once
    ready_batches: int = 4  # run/config.py WireConfig.ready_batches: computed ahead per producer
    log_every: int = 10  # config/train.py TrainConfig.log_every: METRICS from rank 0
    worker_msgs_per_step: int = 2  # worker/loop.py: one ACK and one READY per optimizer step
    coordinator_msgs_per_batch: int = 3  # ASSUMED (not built): lease request, grant, ack forwarded
    keep_alive_s: float = 3.0  # train/distributed.py KEEP_ALIVE_S x KEEP_ALIVE_MISSES (1 s x 3)
    last_call_s: float = 1.0  # train/distributed.py LAST_CALL_S
    nccl_group_init_s: float = 1.85  # regroup_s of a world of 1 on the H200:
    # bench/results/h200_launch_one_gpu_qwen3_tiny_elastic/metrics.jsonl (no larger world measured)
    cpu_regroup_measured_s: float = 3.5  # docs/reliability.md: SIGKILL of 1 of 2 gloo workers, CPU
    cold_first_step_s: float = 171.0  # 27B drafter warm-up, cold cache: docs/performance.md (162-171 s)
    grad_bytes: int = 4  # fp32 master weights: sum_gradients all-reduces p.grad in the param dtype
    optimizer_state_bytes: int = 8  # AdamW exp_avg + exp_avg_sq in fp32, broadcast at every hand-over


@dataclass(frozen=True, slots=True)
class RunShape:
    """The run being modelled."""

    nodes: int = 64
    gpus_per_node: int = 8
    training_tokens: float = 1e9  # tokens trained over all epochs
    epochs: int = 6  # DESIGN.md recipe
    batch_tokens: float = 3457.0  # mean planned batch at --token-budget 4096:
    # bench/results/cpu_batch_balance/batch_balance.json (mean_batch_tokens)
    max_batch_tokens: float = 4081.0  # same file, batch_tokens_max
    mean_sample_tokens: float = 1077.0  # same file: 187 batches x 3457 tokens / 600 samples
    max_samples_per_batch: int = 29  # 27B sweep at the launch defaults: 1 to 29 samples (performance.md)
    generated_per_trained: float = 0.84  # --responses target: generated tokens per trained token
    # (docs/performance.md, bench/results/h200_decode_kernel_writes_auto_batch/)


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    target: Target
    drafter: Drafter
    gpu: Gpu = field(default_factory=Gpu)
    protocol: Protocol = field(default_factory=Protocol)
    run: RunShape = field(default_factory=RunShape)


# ---------------------------------------------------------------------------------------------------------
# shapes


def feature_layer_ids(layers: int, n: int) -> list[int]:
    """DESIGN.md: round(1 + i*(L-4)/(n-1)); one layer: [L // 2]."""
    if n == 1:
        return [layers // 2]
    return [round(1 + i * (layers - 4) / (n - 1)) for i in range(n)]


def layers_run(t: Target) -> int:
    """The producer stops after the last feature layer (id i is hidden_states[i + 1]: i + 1 layers)."""
    return max(feature_layer_ids(t.layers, t.feature_layers)) + 1


def feature_bytes_per_token(t: Target) -> int:
    """Features alone: k layers x H x bytes (51,200 B at the 27B width, DESIGN.md)."""
    return t.feature_layers * t.hidden * t.feature_bytes


def batch_bytes_per_token(t: Target) -> int:
    """A BATCH's tensors per token: features + input_ids (int64) + loss_mask (bool), wire/messages.py."""
    return feature_bytes_per_token(t) + 8 + 1


def drafter_params(d: Drafter, feature_layers: int) -> float:
    """Trainable parameters: per layer q/k/v/o + SwiGLU + 2 norms + q/k norms, then fc (k*H -> H) and two
    norms; the embedding and LM head are the target's, frozen (DESIGN.md)."""
    attn = d.hidden * d.heads * d.head_dim * 2 + d.hidden * d.kv_heads * d.head_dim * 2
    layer = attn + 3 * d.hidden * d.ffn + 2 * d.hidden + 2 * d.head_dim
    return d.layers * layer + feature_layers * d.hidden * d.hidden + 2 * d.hidden


def replica_gpus(c: Case) -> int:
    """GPUs one target replica needs for its weights: a power of two within a node, whole nodes beyond."""
    need = math.ceil(
        c.target.total_params * c.target.weight_bytes / (c.gpu.memory_gb * 1e9 * c.gpu.usable_memory_share)
    )
    if need <= c.run.gpus_per_node:
        return 1 << (need - 1).bit_length()
    return c.run.gpus_per_node * math.ceil(need / c.run.gpus_per_node)


# ---------------------------------------------------------------------------------------------------------
# supply and demand


def target_seconds_per_trained_token(c: Case, regen: bool) -> float:
    """GPU-seconds of target per trained token: its features, plus (regenerating) its share of decoding."""
    s = 1.0 / c.target.feature_tokens_per_gpu_s
    if regen:
        s += c.run.generated_per_trained / c.target.decode_tokens_per_gpu_s
    return s


def lockstep_share(r: RunShape) -> float:
    """Many workers step together, so the slowest batch of a step sets it: with hundreds of workers nearly
    every step holds a batch at the largest size; mean / max batch tokens is that floor (token-cost model;
    measured 0.938 at 2 and 0.915 at 3 workers, bench/results/cpu_batch_balance/batch_balance.json)."""
    return r.batch_tokens / r.max_batch_tokens


def allreduce_bytes_per_step(c: Case, ranks: int) -> float:
    """Ring all-reduce: each rank sends (and receives) 2 (N-1)/N of the gradient bytes."""
    grad = drafter_params(c.drafter, c.target.feature_layers) * c.protocol.grad_bytes
    return 2 * (ranks - 1) / ranks * grad if ranks > 1 else 0.0


def drafter_step(c: Case, ranks: int) -> dict:
    """One worker's step at scale: its compute (lockstep included) plus the gradient all-reduce, which
    today runs after the backward, not overlapped with it (train/distributed.py sum_gradients)."""
    compute_s = c.run.batch_tokens / (c.drafter.tokens_per_gpu_s * lockstep_share(c.run))
    reduce_bytes = allreduce_bytes_per_step(c, ranks)
    reduce_s = reduce_bytes / (c.gpu.internode_busbw_gb_s * 1e9)
    step_s = compute_s + reduce_s
    return {
        "compute_s": compute_s,
        "allreduce_s": reduce_s,
        "step_s": step_s,
        "allreduce_bytes_per_gpu": reduce_bytes,
        "tokens_per_gpu_s": c.run.batch_tokens / step_s,
    }


def best_split(c: Case, regen: bool) -> dict:
    """The target/drafter GPU split with the most trained tokens/s. A replica within a node: split every
    node alike (its producer feeds its own workers). A replica over whole nodes: split the cluster by
    nodes (target nodes feed drafter nodes over the network)."""
    g, n = c.run.gpus_per_node, c.run.nodes
    rep = replica_gpus(c)
    supply = 1.0 / target_seconds_per_trained_token(c, regen)  # trained tokens/s per target GPU
    per_node = rep <= g
    units = g if per_node else g * n  # the GPUs being split: one node's, or the cluster's
    if rep >= units:
        raise ValueError(f"{c.name}: a target replica needs {rep} GPUs, leaving none of {units} for drafters")
    best = None
    for t in range(rep, units, rep):
        d = units - t
        ranks = d * n if per_node else d
        demand = drafter_step(c, ranks)["tokens_per_gpu_s"]
        rate = min(t * supply, d * demand) * (n if per_node else 1)
        if best is None or rate > best["trained_tokens_s"]:
            best = {"target_gpus": t, "drafter_gpus": d, "trained_tokens_s": rate, "demand": demand}
    target_share = best["demand"] / (supply + best["demand"])  # continuous: t*supply == (1-t)*demand
    scope = "per node" if per_node else "cluster"
    return {
        "scope": scope,
        "replica_gpus": rep,
        "target_gpus": best["target_gpus"],
        "drafter_gpus": best["drafter_gpus"],
        "supply_tokens_s": best["target_gpus"] * supply,
        "demand_tokens_s": best["drafter_gpus"] * best["demand"],
        "supply_per_target_gpu": supply,
        "demand_per_drafter_gpu": best["demand"],
        "balanced_target_share": target_share,
        "lockstep_share": lockstep_share(c.run),
        "target_feature_tokens_per_gpu_s": c.target.feature_tokens_per_gpu_s,
        "target_decode_tokens_per_gpu_s": c.target.decode_tokens_per_gpu_s,
        "cluster_trained_tokens_s": best["trained_tokens_s"],
        "target_gpus_total": best["target_gpus"] * (n if per_node else 1),
        "drafter_gpus_total": best["drafter_gpus"] * (n if per_node else 1),
    }


# ---------------------------------------------------------------------------------------------------------
# links, coordinator, ledger, recovery


def links(c: Case, split: dict) -> dict:
    """Bytes per second on each kind of link at the chosen split."""
    tok_s = split["cluster_trained_tokens_s"]
    bpt = batch_bytes_per_token(c.target)
    drafters = split["drafter_gpus_total"]
    step = drafter_step(c, drafters)
    steps_s = tok_s / drafters / c.run.batch_tokens  # optimizer steps per second (one batch per step)
    local = split["scope"] == "per node"
    features_s = tok_s * bpt
    drafter_nodes = drafters / c.run.gpus_per_node
    target_nodes = split["target_gpus_total"] / c.run.gpus_per_node
    return {
        "feature_bytes_per_token": feature_bytes_per_token(c.target),
        "batch_bytes_per_token": bpt,
        "features_same_node_bytes_s_per_node": features_s / c.run.nodes if local else 0.0,
        "features_cross_node_bytes_s_per_node": 0.0 if local else features_s / drafter_nodes,
        "features_cross_node_egress_bytes_s_per_target_node": 0.0 if local else features_s / target_nodes,
        "drafter_params": drafter_params(c.drafter, c.target.feature_layers),
        "allreduce_bytes_per_step_per_gpu": step["allreduce_bytes_per_gpu"],
        "allreduce_s_per_step": step["allreduce_s"],
        "step_s": step["step_s"],
        "allreduce_share_of_step": step["allreduce_s"] / step["step_s"],
        "steps_per_s": steps_s,
        "gradient_bytes_s_per_gpu": step["allreduce_bytes_per_gpu"] * steps_s,
    }


def coordinator(c: Case, split: dict, link: dict) -> dict:
    """Messages per second: each worker with its producer, each producer with the run's coordinator."""
    p = c.protocol
    steps_s = link["steps_per_s"]
    beat = 1.0 / p.heartbeat_s
    worker_out = steps_s * p.worker_msgs_per_step + beat  # ACK + READY each step, a heartbeat
    # (rank 0 alone adds METRICS every log_every steps: counted once, at the coordinator)
    worker_in = steps_s + beat  # one BATCH per step, the producer's heartbeat
    drafters = split["drafter_gpus_total"]
    # one producer process per node holds all its replicas; a replica over nodes is a producer of its own
    per_node = split["scope"] == "per node"
    producers = c.run.nodes if per_node else split["target_gpus_total"] // split["replica_gpus"]
    workers_per_producer = drafters / producers
    batches_s = split["cluster_trained_tokens_s"] / c.run.batch_tokens
    return {
        "worker_msgs_s_out": worker_out,
        "worker_msgs_s_in": worker_in,
        "producers": producers,
        "workers_per_producer": workers_per_producer,
        "producer_msgs_s_with_workers": workers_per_producer * (worker_in + worker_out),
        "producer_msgs_s_with_coordinator": batches_s / producers * p.coordinator_msgs_per_batch + 2 * beat,
        "coordinator_msgs_s": batches_s * p.coordinator_msgs_per_batch
        + producers * 2 * beat
        + steps_s / p.log_every,
        "batches_s": batches_s,
    }


def ledger(c: Case) -> dict:
    """The ledger (run/ledger.py): a bool per sample per epoch in memory; np.packbits + base64 in the
    checkpoint and in every hand-over (train/handover.py); each step all-gathers (epoch, id) int64 pairs."""
    r = c.run
    samples = math.ceil(r.training_tokens / r.epochs / r.mean_sample_tokens)
    packed = math.ceil(samples / 8)
    return {
        "samples_per_epoch": samples,
        "memory_bytes": samples * r.epochs,
        "serialized_bytes": r.epochs * 4 * math.ceil(packed / 3),
        "ids_allgather_bytes_per_step_per_rank": r.max_samples_per_batch * 2 * 8,
    }


def recovery(c: Case, split: dict, link: dict) -> dict:
    """From a node lost to a group training again, and what the rest of the cluster pays meanwhile."""
    p = c.protocol
    params = link["drafter_params"]
    state_bytes = params * (p.grad_bytes + p.optimizer_state_bytes)  # fp32 weights + AdamW moments
    handover_s = (state_bytes + ledger(c)["serialized_bytes"]) / (c.gpu.internode_busbw_gb_s * 1e9)
    regroup_s = p.keep_alive_s + p.last_call_s + p.nccl_group_init_s + handover_s
    workers_on_node = split["drafter_gpus"] if split["scope"] == "per node" else c.run.gpus_per_node
    relost_batches = workers_on_node * p.worker_credits + p.ready_batches
    relost_tokens = relost_batches * c.run.batch_tokens
    total_gpus = c.run.nodes * c.run.gpus_per_node
    return {
        "handover_state_bytes": state_bytes,
        "handover_s": handover_s,
        "killed_process_s": regroup_s,  # sockets close: the collective fails at once (gloo, measured on CPU)
        "silent_host_s": p.peer_timeout_s + regroup_s,  # no socket closes: the collective timeout first
        "released_batches": relost_batches,
        "released_tokens": relost_tokens,
        "released_tokens_s_of_cluster": relost_tokens / split["cluster_trained_tokens_s"],
        "stalled_gpu_s_killed": regroup_s * total_gpus,
        "replacement_first_step_s": p.cold_first_step_s,
    }


def out_recovery_s(c: Case, split: dict) -> float:
    """Seconds the whole group stands still for one silent host."""
    return recovery(c, split, links(c, split))["silent_host_s"]


def model(c: Case) -> dict:
    """Every figure for one case, with and without regeneration."""
    out: dict = {"case": c.name, "inputs": asdict(c), "layers_run": layers_run(c.target)}
    for mode, regen in (("dataset", False), ("target", True)):
        split = best_split(c, regen)
        link = links(c, split)
        hours = c.run.training_tokens / split["cluster_trained_tokens_s"] / 3600
        out[mode] = {
            "split": split,
            "links": link,
            "coordinator": coordinator(c, split, link),
            "recovery": recovery(c, split, link),
            "hours_for_training_tokens": hours,
            "silent_host_share_of_run": out_recovery_s(c, split) / (hours * 3600),
            "cold_start_share_of_run": c.protocol.cold_first_step_s / (hours * 3600),
        }
    # regeneration writes each sample's responses once (epoch 0); later epochs reuse them
    epoch = c.run.training_tokens / c.run.epochs
    out["hours_regen_then_dataset"] = (
        epoch / out["target"]["split"]["cluster_trained_tokens_s"]
        + (c.run.training_tokens - epoch) / out["dataset"]["split"]["cluster_trained_tokens_s"]
    ) / 3600
    out["ledger"] = ledger(c)
    return out
