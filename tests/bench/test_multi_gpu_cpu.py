"""bench/multi_gpu.py on CPU at tiny settings: each subcommand's JSON fields and sane values."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from tests.bench.helpers import ROOT
from tests.launch_flags import demo_subset

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location("multi_gpu", ROOT / "bench" / "multi_gpu.py")
multi_gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(multi_gpu)

TINY = ["--max-length", "128", "--token-budget", "512", "--draft-layers", "1", "--max-anchors", "8"]
TINY += ["--responses", "dataset"]
"""A one-layer drafter on short samples in small batches, trained on the data's own replies: these benches
measure the pipeline's plumbing, and regeneration has its own bench test (test_throughput_cli)."""


def run(out: Path, *argv: str) -> dict:
    args = multi_gpu.parser().parse_args([*argv, "--out", str(out), "--device", "cpu"])
    result, paths = multi_gpu.run_command(args)
    data = json.loads(paths["json"].read_text())
    assert data["name"] == args.command and paths["json"] == out / f"{args.command}.json"
    assert data["provenance"]["versions"]["torch"] and data["provenance"]["git_sha"]
    assert data["config"]["safe_gpu_env"] == multi_gpu.SAFE_GPU_ENV
    return data


def test_the_safe_gpu_env_is_set_for_every_process():
    for key, value in multi_gpu.SAFE_GPU_ENV.items():
        assert os.environ[key] == value
    assert multi_gpu._env()["NCCL_NVLS_ENABLE"] == "0"


def test_design_topology_follows_the_issue():
    assert multi_gpu.design_topology(2) == ((0,), (1,))
    assert multi_gpu.design_topology(4) == ((0, 1), (2, 3))
    assert multi_gpu.design_topology(8) == ((0, 1, 2, 3, 4), (5, 6, 7))
    with pytest.raises(ValueError, match="--target-gpus"):
        multi_gpu.design_topology(3)


def test_scaling_runs_the_producer_and_1_and_2_drafter_workers(tmp_path: Path):
    """About a minute: the scaling bench's real runs with one and two drafter workers, each with its start-up."""
    tiny = [*TINY, "--data", str(demo_subset(tmp_path / "data.jsonl", 200))]
    producer = run(tmp_path, "scaling-producer", "--seconds", "0.3", *tiny)
    (row,) = producer["rows"]
    assert row["tokens_per_s"] > 0 and row["efficiency"] == 1.0 and row["replicas"] == 1
    drafters = run(tmp_path, "scaling-drafters", "--seconds", "0.5", "--workers", "2", *tiny)
    rows = drafters["rows"]
    assert [r["workers"] for r in rows] == [1, 2]
    for key in ("drafters_alone", "pipeline"):
        one = rows[0][f"{key}_tokens_per_s"]
        assert one > 0 and rows[1][f"{key}_tokens_per_s"] > 0, (
            rows,
            drafters["summary"],
        )  # each worker's window
        assert rows[1][f"{key}_efficiency"] == pytest.approx(
            rows[1][f"{key}_tokens_per_s"] / (2 * one), abs=1e-3
        )
    summary = drafters["summary"]
    assert [len(summary["drafters_alone_per_worker"][k]) for k in ("1", "2")] == [1, 2]
    assert summary["pipeline_efficiency"] == rows[1]["pipeline_efficiency"]
    assert summary["producer_alone_tokens_per_s"] > 0
    assert [g["name"] for g in summary["goals"]] == [
        "drafters alone scaling vs linear",
        "pipeline drafter scaling vs linear",
    ]


def test_elastic_attaches_kills_and_loses_no_sample(tmp_path: Path):
    """Two minutes: the elastic bench attaches workers to a live run and kills one, as on GPUs, on CPU. The
    demo's drafter on 600 samples of up to 256 tokens (~65 steps): in a full suite on 2 cores the attached
    worker took 47 s to join, at step 35 of an epoch of 400 samples that ended at step 43, too close to the
    kill and the recovery; at TINY's sizes an epoch of 800 samples lasted 41 s and ended before them."""
    sizes = ["--max-length", "256", "--token-budget", "1024", "--responses", "dataset"]
    data = run(tmp_path, "elastic", "--workers", "1", "--samples", "600", "--timeout", "120", *sizes)
    (row,) = data["rows"]
    assert row["launched_workers"] == 1 and row["attached_device"] == "cpu"
    assert row["join_step"] <= row["kill_step"] < row["final_step"]
    assert 0 < row["recovery_s"] < 60 and row["join_s"] > 0
    assert row["samples"] == 600 and row["samples_lost"] == 0 and row["epoch_complete"] is True
    assert row["duplicates"] <= row["released_samples"]
    assert data["summary"]["goals"][0]["met"] is True


def test_topology_is_bench_throughput_on_the_layout(tmp_path: Path):
    """About a minute in a full suite: the topology bench measures each stage alone and then a real pipeline
    launch (a producer and its worker processes). Most of the time is those processes' start-ups, and the
    bench's numbers only mean something when the launch is real."""
    # --no-compare: the offline and threaded rows are bench throughput's own, tested in test_throughput_cli.
    tiny = [*TINY, "--data", str(demo_subset(tmp_path / "data.jsonl", 200))]
    data = run(tmp_path, "topology", "--seconds", "0.3", "--no-compare", *tiny)
    stages = {r["stage"]: r["tokens_per_s"] for r in data["rows"]}
    assert stages["pipeline"] > 0 and "offline (disk)" not in stages
    assert data["summary"]["pipeline_efficiency"] > 0 and "where_time_went" in data["summary"]
    assert data["config"]["gradient_backend"] == "gloo" and data["config"]["payload_path"]
