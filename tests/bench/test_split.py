"""`bench split` and `launch --gpus`: the split picked from a probe of each side, by the arithmetic the
docstring states (checked by hand here), and the probe itself on CPU with the pipeline run to verify it."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_pipe.cli import main
from dflash_pipe.run.split import neighbours, shared_device, splits, supply_with_regeneration
from tests.bench.helpers import read_result, run_bench
from tests.launch_flags import demo_subset


def test_the_pick_balances_supply_and_demand() -> None:
    ranked = splits(8, per_target_gpu=1000.0, per_drafter_gpu=3000.0)
    pick = ranked[0]
    assert (pick.target, pick.drafters) == (6, 2)  # 6 x 1000 = 2 x 3000
    assert pick.predicted == 6000.0 and pick.label == "6+2"
    assert [(s.target, s.predicted) for s in neighbours(ranked)] == [(5, 5000.0), (6, 6000.0), (7, 3000.0)]
    assert len(ranked) == 7 and all(
        a.predicted >= b.predicted for a, b in zip(ranked, ranked[1:], strict=False)
    )
    tie = splits(4, per_target_gpu=1000.0, per_drafter_gpu=1000.0)  # 2+2 and nothing better: 2000
    assert tie[0].label == "2+2"
    flat = splits(3, per_target_gpu=1e9, per_drafter_gpu=1.0)  # demand-bound everywhere: fewest target GPUs
    assert flat[0].label == "1+2"
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        splits(1, 1.0, 1.0)


def test_one_device_is_shared_in_proportion_to_each_sides_cost() -> None:
    shared = shared_device(per_target=3000.0, per_drafter=1000.0)
    assert shared["target_share"] == pytest.approx(0.25) and shared["drafter_share"] == pytest.approx(0.75)
    assert shared["predicted_tokens_per_s"] == pytest.approx(750.0)  # 1 / (1/3000 + 1/1000)
    # a replica writing 0.8 generated tokens per trained one, at 1000 generated/s, features at 4000/s
    assert supply_with_regeneration(4000.0, 1000.0, 0.8) == pytest.approx(1 / (1 / 4000 + 0.8 / 1000))


@pytest.mark.slow
def test_bench_split_on_cpu_probes_both_sides_and_verifies_with_the_pipeline(tmp_path: Path) -> None:
    """The probes and the verifying pipeline on 200 demo conversations' own replies (the next test prices
    regeneration): a launch tokenizes its whole data before the first step."""
    out = tmp_path / "res"
    tiny = ["--max-length", "128", "--token-budget", "512", "--draft-layers", "1", "--max-anchors", "8"]
    tiny += ["--responses", "dataset", "--data", str(demo_subset(tmp_path / "data.jsonl", 200))]
    done = run_bench("split", "--device", "cpu", "--seconds", "0.5", "--verify", "--out", str(out), *tiny)
    assert done.returncode == 0, done.stdout + done.stderr
    data = read_result(out, "split")
    s = data["summary"]
    assert s["target_tokens_per_s_per_gpu"] > 0 and s["drafter_tokens_per_s_per_gpu"] > 0
    expected = shared_device(s["target_tokens_per_s_per_gpu"], s["drafter_tokens_per_s_per_gpu"])
    assert s["pick"] == "shared" and s["target_share"] == pytest.approx(expected["target_share"], abs=1e-3)
    (row,) = data["rows"]
    assert row["measured_tokens_per_s"] > 0
    assert s["measured_vs_predicted"] == pytest.approx(
        row["measured_tokens_per_s"] / row["predicted_tokens_per_s"], rel=0.01
    )
    assert "pick: shared: one device: the target needs" in done.stderr + done.stdout


@pytest.mark.slow
def test_bench_split_with_target_responses_prices_regeneration_into_the_supply(tmp_path: Path) -> None:
    out = tmp_path / "res"
    tiny = ["--max-length", "128", "--token-budget", "512", "--draft-layers", "1", "--max-anchors", "8"]
    regen = ["--responses", "target", "--regen-batch", "4", "--max-new-tokens", "8"]
    tiny += ["--data", str(demo_subset(tmp_path / "data.jsonl", 200))]
    done = run_bench("split", "--device", "cpu", "--seconds", "0.5", "--out", str(out), *tiny, *regen)
    assert done.returncode == 0, done.stdout + done.stderr
    s = read_result(out, "split")["summary"]
    assert s["decode_tokens_per_s"] > 0 and 0 < s["generated_per_trained"] < 1 and s["decode_batch"] == 4
    expected = supply_with_regeneration(
        s["feature_tokens_per_s_per_gpu"], s["decode_tokens_per_s"], s["generated_per_trained"]
    )
    assert s["target_tokens_per_s_per_gpu"] == pytest.approx(expected, rel=0.01)
    assert s["target_tokens_per_s_per_gpu"] < s["feature_tokens_per_s_per_gpu"]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--gpus", "0-7", "--target-gpus", "0"], "Give --gpus alone"),
        (["--gpus", "0-1", "--device", "cpu"], "the CPU has no GPUs to split"),
        (["--gpus", "x"], "--gpus"),
    ],
)
def test_launch_gpus_is_refused_with_a_split_or_on_cpu(args: list[str], says: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["launch", *args, "--run-dir", str(tmp_path / "r"), "--dry-run"])
    assert result.exit_code == 2 and says in result.output, result.output


def test_launch_gpus_dry_run_says_a_probe_picks_the_split(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["launch", "--gpus", "0-7", "--run-dir", str(tmp_path / "r"), "--dry-run"]
    )
    assert result.exit_code == 0, result.output
    assert (
        "a probe picks the split when the run starts" in result.output
        and "nothing was started" in result.output
    )
