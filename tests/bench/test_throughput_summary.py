"""The throughput summary: efficiency against the slowest stage, and the time-sharing bound on shared devices."""

from __future__ import annotations

import pytest
from rich.console import Console

from dflash_pipe.bench import BenchResult
from dflash_pipe.bench.save import show_result
from dflash_pipe.bench.stages import StageRate
from dflash_pipe.bench.throughput import shared_device_bound, summarize
from dflash_pipe.run.layout import LayoutConfig

WAITS = {"observed_s": 2.0, "target_idle_share": 0.1, "workers_starved_share": 0.0, "queue_depth_mean": 3.0}


def _rates(producer: float, drafters: float, pipeline: float) -> dict[str, StageRate]:
    """Rates over a 1 s window, so tokens == tokens/s."""
    return {
        "producer alone": StageRate("producer alone", int(producer), 1.0),
        "drafters alone": StageRate("drafters alone", int(drafters), 1.0),
        "transport alone": StageRate("transport alone", 500_000, 1.0),
        "pipeline": StageRate("pipeline", int(pipeline), 1.0),
        "offline (disk)": StageRate("offline (disk)", 4000, 1.0),
    }


def test_bound_is_the_time_sharing_rate():
    # A token costs 1/30000 s of target time plus 1/10000 s of drafter time on the same device.
    assert shared_device_bound(30_000, 10_000) == pytest.approx(7500.0)
    assert shared_device_bound(0, 10_000) == 0.0


def test_unshared_gpus_check_the_goal_against_the_slowest_stage():
    layout = LayoutConfig(device="cuda", target_gpus=(0,), drafter_gpus=(1, 2))
    s = summarize(_rates(30_000, 10_000, 9_700), WAITS, "drafters alone", layout)
    assert s["pipeline_efficiency"] == 0.97
    assert "shared_device_bound_tokens_per_s" not in s and "pipeline_vs_shared_bound" not in s
    assert [(g["name"], g["value"], g["met"]) for g in s["goals"]] == [("pipeline efficiency", 0.97, True)]
    assert not any("share" in n and "bound" in n for n in s["notes"])
    assert s["pipeline_vs_offline"] == pytest.approx(9_700 / 4_000, rel=1e-3)


@pytest.mark.parametrize(
    ("layout", "shared"),
    [
        (LayoutConfig(device="cpu"), "the CPU cores"),
        (LayoutConfig(device="cuda", target_gpus=(0,), drafter_gpus=(0,)), "GPU(s) [0]"),
    ],
)
def test_shared_devices_check_the_goal_against_the_bound(layout: LayoutConfig, shared: str):
    # Bound 7500 tok/s; the pipeline reaches 7200: 0.96 of the bound, but only 0.72 of the slowest stage.
    s = summarize(_rates(30_000, 10_000, 7_200), WAITS, "drafters alone", layout)
    assert s["pipeline_efficiency"] == 0.72
    assert s["shared_device_bound_tokens_per_s"] == 7500.0
    assert s["pipeline_vs_shared_bound"] == 0.96
    assert [(g["name"], g["value"], g["met"]) for g in s["goals"]] == [
        ("pipeline vs shared-device bound", 0.96, True)
    ]
    note = next(n for n in s["notes"] if "time-sharing bound" in n)
    assert shared in note and "pipeline_efficiency" in note
    assert any("the bound is then conservative" in n for n in s["notes"]) == (layout.device == "cpu")
    # Below the bound's goal, the verdict says so.
    low = summarize(_rates(30_000, 10_000, 6_000), WAITS, "drafters alone", layout)
    assert low["pipeline_vs_shared_bound"] == 0.8 and not low["goals"][0]["met"]


def test_partly_shared_gpus_say_the_bound_is_conservative():
    layout = LayoutConfig(device="cuda", target_gpus=(0, 1), drafter_gpus=(1, 2))
    s = summarize(_rates(30_000, 10_000, 7_200), WAITS, "drafters alone", layout)
    assert s["pipeline_vs_shared_bound"] == 0.96
    assert any("only some GPUs are shared" in n for n in s["notes"])


def test_the_printed_summary_shows_the_bound_and_its_goal():
    layout = LayoutConfig(device="cpu")
    summary = summarize(_rates(30_000, 10_000, 7_200), WAITS, "drafters alone", layout)
    result = BenchResult(name="throughput", config={}, rows=[], summary=summary, chart={})
    console = Console(record=True, width=400)
    show_result(result, console)
    text = console.export_text()
    assert "shared_device_bound_tokens_per_s: 7,500" in text
    assert "pipeline_efficiency: 0.72" in text
    assert "goal pipeline vs shared-device bound: 0.96 (goal >= 0.95): met" in text
