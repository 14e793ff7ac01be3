"""bench/hybrid_target.py in its CPU synthetic mode: every path runs in its child, the rows and the feature
checks land in the JSON, and the FLOP count is the layers' own matmuls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_pipe.bench.hybrid import PATHS, SHAPES, dense_config, hybrid_config, layer_ids_for, model_flops
from dflash_pipe.target import TargetCore
from tests.bench.helpers import ROOT

pytestmark = pytest.mark.slow


def test_cpu_synthetic_mode_runs_every_path_and_checks_features(tmp_path: Path):
    """About a minute: the hybrid bench runs each feature path of a tiny hybrid target (packed, padded, the
    torch fallback without fla) in its own process and checks each against the samples computed alone."""
    out = tmp_path / "res"
    cmd = [sys.executable, "bench/hybrid_target.py", "--out", str(out), "--shape", "tiny", "--device", "cpu"]
    cmd += ["--batches", "2", "--warmup", "0", "--token-budget", "256", "--min-len", "16", "--max-len", "64"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((out / "hybrid_target.json").read_text())
    rows = {row["path"]: row for row in data["rows"]}
    assert set(rows) == set(PATHS)
    for row in rows.values():
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0 and row["timed_tokens"] > 0 and row["mfu"] is None  # no MFU on CPU
    assert rows["padded"]["packing"] == "padded" and rows["packed"]["packing"] == "packed"
    assert rows["torch_fallback"]["fla_importable"] is False  # the child hid fla before transformers
    details = data["summary"]["details"]
    for path in ("packed", "padded", "torch_fallback"):
        check = details[path]["features_vs_each_sample_alone"]
        assert len(check["rel_err"]) == len(check["lengths"]) and check["max_rel_err"] <= 1e-5, check
    assert details["packed"]["fp32_exactness"]["max_rel_err"] <= 1e-5
    assert data["provenance"]["versions"]["torch"] and data["config"]["shape"] == "tiny"


def test_flops_count_every_matmul_and_the_attention_triangles():
    """Hand count for the tiny shape: per token and layer, the projections and the MLP; the causal triangle of
    each sample in the full-attention layers only (layers 3 and 7 of 8)."""
    f = SHAPES["tiny"]
    h, ffn, heads, kv, hd = (
        f[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        )
    )
    kd, vd = (
        f["linear_num_key_heads"] * f["linear_key_head_dim"],
        f["linear_num_value_heads"] * f["linear_value_head_dim"],
    )
    hv = f["linear_num_value_heads"]
    lengths = [5, 11]
    mlp = 3 * h * ffn
    linear_layer = h * (2 * kd + vd) + h * vd + 2 * h * hv + vd * h + mlp  # qkv, z, b and a, out, MLP
    attention_layer = h * 2 * heads * hd + 2 * h * kv * hd + heads * hd * h + mlp  # gated q, k, v, o, MLP
    triangle = sum(4 * heads * hd * n * (n + 1) // 2 for n in lengths)
    core = TargetCore(hybrid_config("tiny", "float32"), layer_ids_for(8), "cpu", torch.float32)
    want = 2 * (6 * linear_layer + 2 * attention_layer) * sum(lengths) + 2 * triangle
    assert model_flops(core, lengths) == want
    dense = TargetCore(dense_config("tiny", "float32"), layer_ids_for(8), "cpu", torch.float32)
    want = 2 * 8 * (h * (heads + 2 * kv) * hd + heads * hd * h + mlp) * sum(lengths) + 8 * triangle
    assert model_flops(dense, lengths) == want
