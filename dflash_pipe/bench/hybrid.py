"""Hybrid-target producer bench: the Qwen3.5 hybrid (Gated DeltaNet + gated attention) through TargetCore on
packed 16K-token batches, side by side with the same model padded, with the torch fallback (no
flash-linear-attention) and with a dense Qwen3 of the same width; features checked against each sample alone
through the plain HF model in the same run.

Each path runs in a child process of its own (``python -m dflash_pipe.bench.hybrid SPEC``): the torch
fallback needs transformers imported while ``fla`` cannot be (transformers binds its delta-rule kernel at
import), and every path starts from an empty allocator and compile cache, so memory growth per batch is the
path's own. MFU counts the matmuls of the layers run (every ``nn.Linear``: 2 FLOPs per multiply-add) plus
full attention over each sample's causal triangle, against 790 TFLOP/s (the dense producer bench's count);
the delta rule and the conv (a few % of the FLOPs) are not counted.

Past 400 lines because the bench's three paths (padded, packed, the fla kernels), its child process and
its MFU count read together; each is one short function.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dflash_pipe.bench.result import BenchResult
from dflash_pipe.compute.precision import compute_dtype

PEAK_TFLOPS = 790.0  # H200 dense bf16, the MFU reference of this repo (bench/drafter_step.py)
GOAL_MFU = 0.55
PATHS = ("packed", "dense", "padded", "torch_fallback")

SHAPES: dict[str, dict[str, Any]] = {
    # The first 16 layers of Qwen3.5-27B (64 layers; 3 of 4 Gated DeltaNet).
    "qwen3.5-27b-16l": {
        "vocab_size": 248320,
        "hidden_size": 5120,
        "num_hidden_layers": 16,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "intermediate_size": 17408,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
    },
    # CPU synthetic mode: the same structure, tiny.
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
    },
}
CHECK_LENGTHS = [37, 200, 5, 129, 64]
"""The few short samples whose packed features are checked against each sample alone."""


@dataclass(kw_only=True, slots=True)
class PathSpec:
    """One child's job (JSON on its command line)."""

    path: str
    shape: str
    device: str
    batches: int
    warmup: int
    token_budget: int
    min_len: int
    max_len: int
    seed: int = 0
    fp32_check_before_s: float = 0.0
    """The packed path's fp32 check on the device runs if the child is younger than this (0: never)."""


def hybrid_config(shape: str, dtype: str = "bfloat16"):
    """The Qwen3.5 text config of ``shape`` (every 4th layer full attention, partial RoPE 0.25, theta 1e7)."""
    from transformers import AutoConfig

    fields = dict(SHAPES[shape])
    return AutoConfig.for_model(
        "qwen3_5_text",
        **fields,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        torch_dtype=dtype,
    )


def dense_config(shape: str, dtype: str = "bfloat16"):
    """A dense Qwen3 of the same width, heads, depth and MLP (every layer full attention)."""
    from transformers import Qwen3Config

    f = SHAPES[shape]
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    return Qwen3Config(
        **{k: f[k] for k in keep},
        head_dim=f["head_dim"],
        intermediate_size=f["intermediate_size"],
        max_position_embeddings=32768,
        torch_dtype=dtype,
    )


def layer_ids_for(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """Spread over the whole stack, last layer included: the forward runs every layer of the shape."""
    return tuple(int(round(1 + i * (num_layers - 2) / (count - 1))) for i in range(count))


def model_flops(core, lengths: Sequence[int]) -> float:
    """FLOPs of the layers the forward runs: every nn.Linear (2 per multiply-add per token) plus attention over
    each sample's causal triangle in the full-attention layers (QK^T and PV)."""
    from torch import nn

    text = core.config.get_text_config()
    tokens = sum(lengths)
    ran = core.layers[: max(core.layer_ids) + 1]
    linear = sum(
        m.in_features * m.out_features for layer in ran for m in layer.modules() if isinstance(m, nn.Linear)
    )
    types = list(getattr(text, "layer_types", None) or ["full_attention"] * len(core.layers))
    full = sum(1 for t in types[: len(ran)] if t == "full_attention")
    heads, head_dim = int(text.num_attention_heads), int(text.head_dim)
    attention = sum(4 * heads * head_dim * n * (n + 1) // 2 for n in lengths)
    return float(2 * linear * tokens + full * attention)


def plan(spec: PathSpec, vocab: int) -> tuple[list, list[list[int]]]:
    """Seeded random samples in [min_len, max_len], planned into token-budget batches by the producer's
    planner (as in a launch)."""
    import numpy as np
    import torch

    from dflash_pipe.data import plan_batches

    rng = np.random.default_rng(spec.seed)
    mean = (spec.min_len + spec.max_len) / 2
    count = int((spec.warmup + spec.batches + 2) * spec.token_budget / mean * 1.5) + 8
    lengths = rng.integers(spec.min_len, spec.max_len + 1, size=count).tolist()
    samples = [torch.from_numpy(rng.integers(0, vocab, size=int(n))) for n in lengths]
    batches = plan_batches(lengths, spec.token_budget, seed=spec.seed, epoch=0)[: spec.warmup + spec.batches]
    if len(batches) < spec.warmup + spec.batches:
        raise SystemExit(f"only {len(batches)} batches planned; lower --batches")
    return samples, batches


def feature_check(core, vocab: int, lengths: Sequence[int] = CHECK_LENGTHS) -> dict[str, Any]:
    """Packed features of a few short samples against each sample alone through the plain HF model (sdpa,
    ``output_hidden_states=True``, no TargetCore): relative Frobenius error per sample."""
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=g)
    feats = core.features(ids, list(lengths)).float().cpu()
    model = core.model
    before = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    # The plain HF modules: TargetCore's per-instance forwards (compiled layers, wrapped mixers) set aside.
    patched = {m: m.__dict__.pop("forward") for m in model.modules() if "forward" in m.__dict__}
    errors = []
    try:
        with torch.inference_mode():
            for chunk, got in zip(ids.split(list(lengths)), feats.split(list(lengths)), strict=True):
                hs = model(input_ids=chunk[None].to(core.device), output_hidden_states=True, use_cache=False)
                ref = torch.cat([hs.hidden_states[i + 1][0] for i in core.layer_ids], dim=-1).float().cpu()
                errors.append(((got - ref).norm() / ref.norm()).item())
    finally:
        model.set_attn_implementation(before)
        for module, forward in patched.items():
            module.forward = forward
    return {"lengths": list(lengths), "rel_err": errors, "max_rel_err": max(errors)}


def run_path(spec: PathSpec) -> dict[str, Any]:
    """One path: build the target on the device, warm up, time the batches, record memory after each."""
    if spec.path == "torch_fallback":
        sys.modules["fla"] = None  # type: ignore[assignment]  # import fla -> ImportError, before transformers
    import torch

    from dflash_pipe.target import TargetCore

    device = torch.device(spec.device)
    cuda = device.type == "cuda"
    dtype = compute_dtype(device)
    config = (dense_config if spec.path == "dense" else hybrid_config)(spec.shape)
    ids = layer_ids_for(config.num_hidden_layers)
    torch.manual_seed(spec.seed)
    t0 = time.perf_counter()
    core = TargetCore(config, ids, device, dtype, packing="padded" if spec.path == "padded" else "packed")
    build_s = time.perf_counter() - t0
    samples, batches = plan(spec, config.vocab_size)

    def run(batch: list[int]) -> None:
        core.features(torch.cat([samples[i] for i in batch]), [len(samples[i]) for i in batch])

    _progress(f"{spec.path}: built in {build_s:.1f} s, {len(batches)} batches planned")
    t0 = time.perf_counter()
    for k, batch in enumerate(batches[: spec.warmup]):
        run(batch)
        if cuda:
            torch.cuda.synchronize(device)
        _progress(f"{spec.path}: warm-up batch {k} done at {time.perf_counter() - t0:.1f} s")
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    warmup_s = time.perf_counter() - t0
    memory, seconds = [], []
    for batch in batches[spec.warmup :]:
        t = time.perf_counter()
        run(batch)
        if cuda:
            torch.cuda.synchronize(device)
            memory.append(torch.cuda.memory_allocated(device) / 2**20)
        seconds.append(time.perf_counter() - t)
        _progress(f"{spec.path}: timed batch {len(seconds)} in {seconds[-1]:.3f} s")
    lengths = [len(samples[i]) for b in batches[spec.warmup :] for i in b]
    tokens, total = sum(lengths), sum(seconds)
    flops = model_flops(core, lengths)
    row = {
        "path": spec.path,
        "tokens_per_s": tokens / total,
        "mfu": flops / total / (PEAK_TFLOPS * 1e12) if cuda else None,
        "tflops_per_s": flops / total / 1e12,
        "timed_batches": len(seconds),
        "timed_tokens": tokens,
        "median_batch_s": sorted(seconds)[len(seconds) // 2],
        "attention": core.attention,
        "packing": core.packing,
        "layers_compiled": core.layers_compiled,
        "build_s": build_s,
        "warmup_s": warmup_s,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "allocated_mib_after_each_batch": memory,
        "allocated_growth_mib": (memory[-1] - memory[0]) if memory else None,
        "fla_importable": _fla_importable(),
    }
    if spec.path != "dense":
        row["features_vs_each_sample_alone"] = feature_check(core, config.vocab_size)
        _progress(f"{spec.path}: features checked: {row['features_vs_each_sample_alone']['rel_err']}")
    return row


def _progress(message: str) -> None:
    """Child progress on stderr (the parent keeps its tail when a path times out)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _fla_importable() -> bool:
    try:
        import fla  # noqa: F401
    except ImportError:
        return False
    return True


def fp32_exactness(device: str) -> dict[str, Any]:
    """The fast path's exactness in fp32 on the bench's device: the tiny shape, packed through TargetCore
    against each sample alone through the plain HF model."""
    import torch

    from dflash_pipe.target import TargetCore

    config = hybrid_config("tiny", "float32")
    torch.manual_seed(0)
    core = TargetCore(config, layer_ids_for(config.num_hidden_layers, 3), torch.device(device), torch.float32)
    return feature_check(core, config.vocab_size, [7, 70, 1, 130, 33])


def run_child(spec: PathSpec, timeout_s: float) -> dict[str, Any]:
    """``spec`` in a fresh interpreter; its row (or the error it died with)."""
    cmd = [sys.executable, "-m", "dflash_pipe.bench.hybrid", json.dumps(asdict(spec))]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out, err = (_text(exc.stdout), _text(exc.stderr))
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        row = json.loads(lines[-1]) if lines else {"path": spec.path}
        return {**row, "error": f"timed out after {timeout_s:.0f} s", "stderr_tail": err.splitlines()[-15:]}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
        return {"path": spec.path, "error": f"exit {done.returncode}", "stderr_tail": tail}
    return json.loads(lines[-1])


_DETAIL_KEYS = (
    "allocated_mib_after_each_batch",
    "features_vs_each_sample_alone",
    "fp32_exactness",
    "stderr_tail",
)


def bench_hybrid(
    *,
    shape: str,
    device: str,
    paths: Sequence[str],
    batches: int,
    warmup: int,
    token_budget: int,
    min_len: int,
    max_len: int,
    child_timeout_s: float,
    on_path: Callable[[BenchResult], object] | None = None,
) -> BenchResult:
    """Every path in its own child; rows of figures, per-path details and the goal checks in the summary.
    ``on_path(result so far)`` after each path (the script saves it: a later path's timeout loses nothing)."""
    rows: list[dict[str, Any]] = []
    details: dict[str, Any] = {}
    result = None
    for path in paths:
        spec = PathSpec(
            path=path,
            shape=shape,
            device=device,
            # the torch fallback is ~10x slower: a few batches say what it costs
            batches=max(1, batches // 4) if path == "torch_fallback" else batches,
            warmup=min(warmup, 1) if path == "torch_fallback" else warmup,
            token_budget=token_budget,
            min_len=min_len,
            max_len=max_len,
            fp32_check_before_s=child_timeout_s / 2,
        )
        started = time.perf_counter()
        row = run_child(spec, child_timeout_s)
        row["wall_s"] = time.perf_counter() - started
        details[path] = {k: row.pop(k) for k in _DETAIL_KEYS if k in row}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, (list, dict))}), flush=True)
        result = _result(rows, details, shape, device, paths, batches, warmup, token_budget, min_len, max_len)
        if on_path is not None:
            on_path(result)
    assert result is not None, "no paths given"
    return result


def _result(
    rows, details, shape, device, paths, batches, warmup, token_budget, min_len, max_len
) -> BenchResult:
    """The BenchResult of the paths run so far."""
    from dflash_pipe.bench.save import goal

    by_path = {r["path"]: r for r in rows}
    packed = by_path.get("packed", {})
    checks = {
        p: d["features_vs_each_sample_alone"]["max_rel_err"]
        for p, d in details.items()
        if "features_vs_each_sample_alone" in d
    }
    summary: dict[str, Any] = {
        "packed_mfu": packed.get("mfu"),
        "packed_vs_padded": _ratio(packed, by_path.get("padded")),
        "packed_vs_torch_fallback": _ratio(packed, by_path.get("torch_fallback")),
        "packed_vs_dense": _ratio(packed, by_path.get("dense")),
        "features_max_rel_err": checks,
        "packed_fp32_max_rel_err": details.get("packed", {}).get("fp32_exactness", {}).get("max_rel_err"),
        "details": details,
        "goals": [goal("packed hybrid MFU (H200)", packed.get("mfu"), at_least=GOAL_MFU)]
        if device != "cpu"
        else [],
    }
    config = {
        "shape": shape,
        "target_config": SHAPES[shape],
        "device": device,
        "paths": list(paths),
        "batches": batches,
        "warmup": warmup,
        "token_budget": token_budget,
        "min_len": min_len,
        "max_len": max_len,
        "layer_ids": list(layer_ids_for(SHAPES[shape]["num_hidden_layers"])),
        "peak_tflops": PEAK_TFLOPS,
        "check_lengths": CHECK_LENGTHS,
    }
    return BenchResult(name="hybrid_target", config=config, rows=rows, summary=summary)


def _ratio(a: dict | None, b: dict | None) -> float | None:
    if not a or not b or "tokens_per_s" not in a or "tokens_per_s" not in b:
        return None
    return a["tokens_per_s"] / b["tokens_per_s"]


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _main(argv: list[str]) -> None:
    started = time.perf_counter()
    spec = PathSpec(**json.loads(argv[0]))
    row = run_path(spec)
    print(json.dumps(row), flush=True)  # kept even if the fp32 check below runs out of time
    if spec.path == "packed" and time.perf_counter() - started < spec.fp32_check_before_s:
        row["fp32_exactness"] = fp32_exactness(spec.device)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
