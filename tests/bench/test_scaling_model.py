"""bench/scaling_model.py and dflash_pipe.bench.scaling: the paper model's figures against hand arithmetic,
the wire's real encoding, the real ledger, and the recorded results its constants cite."""

from __future__ import annotations

import base64
import importlib.util
import json
import math
import sys
from dataclasses import replace

import pytest
import torch

from dflash_pipe.bench import scaling as sc
from dflash_pipe.run.ledger import Ledger
from dflash_pipe.wire import codec
from dflash_pipe.wire import messages as m
from tests.bench.helpers import ROOT

_spec = importlib.util.spec_from_file_location("scaling_model", ROOT / "bench" / "scaling_model.py")
scaling_model = importlib.util.module_from_spec(_spec)
sys.modules["scaling_model"] = scaling_model
_spec.loader.exec_module(scaling_model)

RESULTS = ROOT / "bench" / "results"


def small_case(*, feature_rate: float = 3000.0, drafter_rate: float = 1000.0, nodes: int = 2) -> sc.Case:
    """A tiny target on one GPU, a balanced batch plan (lockstep share 1) and a network so fast that the
    all-reduce costs nothing: supply and demand are then the two rates alone."""
    target = sc.Target(
        name="tiny", hidden=64, layers=8, total_params=1e8, active_params=1e8, weight_bytes=2,
        feature_tokens_per_gpu_s=feature_rate, feature_source="test",
        decode_tokens_per_gpu_s=500.0, decode_source="test",
    )  # fmt: skip
    drafter = sc.Drafter(
        hidden=64,
        heads=4,
        kv_heads=2,
        head_dim=16,
        ffn=128,
        tokens_per_gpu_s=drafter_rate,
        rate_source="test",
    )
    run = sc.RunShape(
        nodes=nodes, training_tokens=1e6, epochs=2, batch_tokens=1000.0, max_batch_tokens=1000.0
    )
    gpu = sc.Gpu(internode_busbw_gb_s=1e12)
    return sc.Case(name="small", target=target, drafter=drafter, gpu=gpu, run=run)


def test_feature_layers_and_bytes_per_token_by_hand():
    assert sc.feature_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # DESIGN.md
    t = small_case().target
    assert sc.layers_run(replace(t, layers=36)) == 34  # "34 of 36 layers" (docs/performance.md)
    assert sc.feature_bytes_per_token(t) == 64 * 5 * 2
    assert sc.batch_bytes_per_token(t) == 64 * 5 * 2 + 8 + 1
    big = scaling_model.hybrid_27b().target
    assert sc.feature_bytes_per_token(big) == 5120 * 5 * 2 == 51_200  # DESIGN.md: 51 KB at the 27B width
    assert sc.layers_run(big) == 62


def test_batch_bytes_per_token_is_what_the_wire_encodes():
    """A real BATCH through wire/codec.py: its bytes are T tokens x batch_bytes_per_token plus a header."""
    t = small_case().target
    tokens = 512
    msg = m.Batch(
        batch_id=0, epoch=0, sample_ids=[0, 1], lengths=[200, 312],
        tensors={
            "input_ids": torch.zeros(tokens, dtype=torch.int64),
            "loss_mask": torch.ones(tokens, dtype=torch.bool),
            "features": torch.zeros(tokens, t.feature_layers * t.hidden, dtype=torch.bfloat16),
        },
    )  # fmt: skip
    frames = codec.encode(msg, frame_bytes=1 << 20)
    total = sum(memoryview(f).nbytes for f in frames)
    expected = tokens * sc.batch_bytes_per_token(t)
    assert expected <= total <= expected + 1024  # the msgpack header is a few hundred bytes


def test_drafter_parameters_match_the_recorded_counts():
    d27 = scaling_model.hybrid_27b().drafter
    assert sc.drafter_params(d27, 5) == pytest.approx(1.84e9, rel=5e-3)  # performance.md: 1.84B trainable
    d8 = sc.Drafter(
        hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=12288, tokens_per_gpu_s=1, rate_source=""
    )
    assert sc.drafter_params(d8, 5) == pytest.approx(1.05e9, rel=5e-3)  # DESIGN.md: about 1.05B
    moe = scaling_model.moe_1t()
    ratio = sc.drafter_params(d27, 5) / sc.drafter_params(moe.drafter, 5)  # the MoE drafter's assumed rate
    assert moe.drafter.tokens_per_gpu_s == pytest.approx(scaling_model.DRAFTER_27B_RATE * ratio)


def test_split_balances_supply_and_demand():
    c = small_case()
    split = sc.best_split(c, regen=False)
    # 8 GPUs, 3000 vs 1000 tokens/s per GPU: 2 target GPUs feed 6 drafter GPUs exactly
    assert (split["target_gpus"], split["drafter_gpus"]) == (2, 6)
    assert split["supply_tokens_s"] == pytest.approx(split["demand_tokens_s"], rel=1e-6)
    assert split["supply_tokens_s"] == pytest.approx(6000.0, rel=1e-6)
    assert split["balanced_target_share"] == pytest.approx(0.25, rel=1e-6)
    assert split["cluster_trained_tokens_s"] == pytest.approx(2 * 6000.0, rel=1e-6)  # two nodes alike


def test_regeneration_adds_its_decoding_to_every_trained_token():
    c = small_case()
    per_token = sc.target_seconds_per_trained_token(c, regen=True)
    assert per_token == pytest.approx(1 / 3000 + 0.84 / 500)
    split = sc.best_split(c, regen=True)
    supply = split["target_gpus"] / per_token
    assert split["supply_tokens_s"] == pytest.approx(supply)
    assert split["target_gpus"] > sc.best_split(c, regen=False)["target_gpus"]


def test_allreduce_bytes_and_replicas_by_hand():
    c = small_case()
    params = sc.drafter_params(c.drafter, 5)
    assert sc.allreduce_bytes_per_step(c, 4) == pytest.approx(2 * 3 / 4 * params * 4)
    assert sc.allreduce_bytes_per_step(c, 1) == 0.0
    assert sc.replica_gpus(scaling_model.hybrid_27b()) == 1  # 54 GB of bf16 on one 141 GB GPU
    assert sc.replica_gpus(scaling_model.moe_1t()) == 16  # 1.04 TB of fp8: 9 GPUs' worth, two whole nodes


def test_worker_messages_by_hand():
    c = small_case()
    out = sc.model(c)["dataset"]
    steps_s = 1000.0 / 1000.0  # a drafter GPU trains 1000 tokens/s, one 1000-token batch a step
    assert out["links"]["steps_per_s"] == pytest.approx(steps_s)
    assert out["coordinator"]["worker_msgs_s_out"] == pytest.approx(2 * steps_s + 1 / 2.0)
    assert out["coordinator"]["worker_msgs_s_in"] == pytest.approx(steps_s + 1 / 2.0)
    assert out["links"]["features_cross_node_bytes_s_per_node"] == 0.0  # each node feeds itself


def test_ledger_bytes_are_the_real_ledgers_and_scale_with_samples():
    c = small_case()
    figures = sc.ledger(c)
    samples = figures["samples_per_epoch"]
    assert samples == math.ceil(1e6 / 2 / c.run.mean_sample_tokens)  # tokens per epoch / tokens per sample
    real = Ledger(samples, c.run.epochs)
    for epoch in range(c.run.epochs):
        real.mark(epoch, range(0, samples, 3))
    encoded = real.to_dict()["bitmaps"]
    assert figures["serialized_bytes"] == sum(len(v) for v in encoded.values())
    assert len(base64.b64decode(encoded["0"])) == -(-samples // 8)
    doubled = sc.ledger(replace(c, run=replace(c.run, training_tokens=2e6)))
    assert doubled["samples_per_epoch"] == pytest.approx(2 * samples, abs=1)
    assert doubled["memory_bytes"] == pytest.approx(2 * figures["memory_bytes"], abs=c.run.epochs)


def test_constants_equal_the_recorded_results_they_cite():
    sweep = json.loads((RESULTS / "h200_compile_sweep/steps_27b_from_230/compile_sweep.json").read_text())
    rows = [r for r in sweep["rows"] if r.get("seconds") and r.get("update_seconds") is not None]
    rate = sum(r["tokens"] for r in rows) / sum(r["seconds"] + r["update_seconds"] for r in rows)
    assert pytest.approx(rate, rel=1e-3) == scaling_model.DRAFTER_27B_RATE
    hybrid = json.loads((RESULTS / "h200_hybrid_target/hybrid_target.json").read_text())
    packed = next(r for r in hybrid["rows"] if r["path"] == "packed")
    assert pytest.approx(packed["tokens_per_s"], rel=1e-3) == scaling_model.HYBRID_16L_FEATURES
    decode = json.loads(
        (RESULTS / "h200_decode_kernel_writes_auto_batch/decode_speed_hybrid.json").read_text()
    )
    engine = next(r for r in decode["rows"] if r["path"] == "engine, batch 64")
    assert pytest.approx(engine["tokens_per_s"], rel=1e-3) == scaling_model.HYBRID_16L_DECODE
    balance = json.loads((RESULTS / "cpu_batch_balance/batch_balance.json").read_text())
    run = sc.RunShape()
    assert run.batch_tokens == balance["rows"][0]["mean_batch_tokens"]
    assert run.max_batch_tokens == balance["summary"]["batch_tokens_max"]
    assert run.mean_sample_tokens == pytest.approx(187 * 3457 / 600, rel=1e-3)


def test_main_writes_markdown_and_json(tmp_path):
    results = scaling_model.main(["--out", str(tmp_path), "--nodes", "4"])
    text = (tmp_path / "scaling_model.md").read_text()
    data = json.loads((tmp_path / "scaling_model.json").read_text())
    assert [r["case"] for r in data["cases"]] == ["hybrid_27b", "moe_1t"] == [r["case"] for r in results]
    assert len(data["checks"]) == 4 and "| checked here |" in text
    assert "51.20 KB" in text and "| ledger |" in text
    assert data["cases"][0]["inputs"]["run"]["nodes"] == 4


def test_docs_scaling_pastes_the_current_output(tmp_path):
    """docs/scaling.md's tables are the script's output at the defaults, not typed by hand: rerun it and
    find every line in the doc (rerun `python bench/scaling_model.py --out bench/results/scaling_model`
    and paste again when the model changes)."""
    scaling_model.main(["--out", str(tmp_path)])
    doc = (ROOT / "docs" / "scaling.md").read_text().splitlines()
    missing = [line for line in (tmp_path / "scaling_model.md").read_text().splitlines() if line not in doc]
    assert not missing, missing[:3]
    recorded = (ROOT / "bench" / "results" / "scaling_model" / "scaling_model.md").read_text()
    assert recorded == (tmp_path / "scaling_model.md").read_text()
