"""`dflash-pipe bench throughput` on CPU with tiny settings: every stage, the pipeline, offline, files."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.helpers import ON_EACH_DEVICE, read_result, run_bench

pytestmark = pytest.mark.slow


DEVICES = {
    "cpu": ["--device", "cpu"],
    "cuda": ["--device", "cuda", "--target-gpus", "0", "--drafter-gpus", "0"],
}


@ON_EACH_DEVICE
def test_throughput_measures_every_stage_and_the_pipeline(tmp_path: Path, device: str):
    out = tmp_path / "res"
    tiny = ["--max-length", "128", "--token-budget", "512", "--draft-layers", "1", "--max-anchors", "8"]
    done = run_bench(
        "throughput", *DEVICES[device], "--seconds", "0.5", "--compare", "--out", str(out), *tiny
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data = read_result(out, "throughput")
    rates = {row["stage"]: row["tokens_per_s"] for row in data["rows"]}
    for stage in ("producer alone", "drafters alone", "transport alone", "pipeline", "offline (disk)"):
        assert rates[stage] > 0, (stage, data["rows"])
    summary = data["summary"]
    slowest = min(("producer alone", "drafters alone", "transport alone"), key=rates.get)
    assert summary["slowest_stage"] == slowest
    assert 0 < summary["pipeline_efficiency"] <= 1.5
    assert summary["pipeline_efficiency"] == pytest.approx(rates["pipeline"] / rates[slowest], rel=0.01)
    waits = summary["where_time_went"]
    assert waits["observed_s"] > 0 and 0 <= waits["target_idle_share"] <= 1
    assert 0 <= waits["workers_starved_share"] <= 1 and waits["queue_depth_mean"] >= 0
    assert summary["pipeline_vs_offline"] > 0
    threads = "threads" in rates or any("threads: not available" in n for n in summary["notes"])
    assert threads, summary
    offline = next(r for r in data["rows"] if r["stage"] == "offline (disk)")["detail"]
    assert offline["disk_bytes"] > 0 and offline["write_s"] > 0 and offline["train_s"] > 0
    assert data["provenance"]["versions"]["torch"] and data["config"]["device"] == device
    # Both device set-ups here share devices (the CPU cores, or GPU 0): the goal is against the bound.
    bound = 1 / (1 / rates["producer alone"] + 1 / rates["drafters alone"])
    assert summary["shared_device_bound_tokens_per_s"] == pytest.approx(bound, rel=0.01)
    assert summary["pipeline_vs_shared_bound"] == pytest.approx(rates["pipeline"] / bound, rel=0.01)
    assert "goal pipeline vs shared-device bound" in done.stdout and "tokens_per_s" in done.stdout
