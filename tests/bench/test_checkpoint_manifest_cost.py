"""bench/checkpoint_manifest_cost.py on the demo shape: the real drafter's tensors, a verified checkpoint."""

from __future__ import annotations

import importlib.util
import json

import torch

from dflash_pipe.train import checkpoint as ck
from tests.bench.helpers import ROOT
from tests.drafter.conftest import tiny_config, tiny_drafter

_spec = importlib.util.spec_from_file_location(
    "manifest_cost", ROOT / "bench" / "checkpoint_manifest_cost.py"
)
manifest_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(manifest_cost)


def test_the_bench_saves_the_drafters_tensors_and_times_the_manifest(tmp_path) -> None:
    hidden, inter, heads, kv, head_dim, layers = manifest_cost.SHAPES["demo"]
    cfg = tiny_config(
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        num_hidden_layers=layers,
        target_layer_ids=(1, 2, 3),
        num_target_layers=6,
    )
    real = sorted(tuple(t.shape) for t in ck.trainable_state(tiny_drafter(cfg)).values())
    bench = sorted(
        tuple(p.shape) for p in manifest_cost.DrafterTensors(*manifest_cost.SHAPES["demo"]).parameters()
    )
    assert bench == real  # the bench checkpoints what a demo run checkpoints
    result = manifest_cost.main(["--shape", "demo", "--out", str(tmp_path), "--big-mib", "4"])
    assert set(result["bytes"]) == {*ck.REQUIRED_FILES, ck.MANIFEST}
    assert result["trainable_params"] == sum(torch.Size(s).numel() for s in real)
    assert 0 < result["manifest_s"] < result["save_s"] and result["verify_s"] > 0
    assert result["big_file"]["1_thread_gb_per_s"] > 0
    saved = json.loads((tmp_path / "checkpoint_manifest_cost_demo.json").read_text())
    assert saved["trainable_params"] == result["trainable_params"]
