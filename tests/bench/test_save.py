"""Bench results: JSON round trip with provenance, the PNG chart, the rich table and the goal checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from dflash_pipe.bench import BenchResult
from dflash_pipe.bench.save import goal, load_result, provenance, save_result, show_result


def _result(kind: str = "bar") -> BenchResult:
    rows = [
        {"stage": "producer alone", "size_mib": 1.0, "tokens_per_s": 12345.6, "transport": "tcp"},
        {"stage": "drafters alone", "size_mib": 4.0, "tokens_per_s": 6789.0, "transport": "tcp"},
        {"stage": "pipeline", "size_mib": 4.0, "tokens_per_s": 6500.5, "transport": "ipc"},
    ]
    chart = (
        {"x": "stage", "y": "tokens_per_s", "kind": "bar", "title": "by stage"}
        if kind == "bar"
        else {"x": "size_mib", "y": "tokens_per_s", "group": "transport", "kind": "line", "log_x": True}
    )
    summary = {
        "pipeline_efficiency": 0.957,
        "goals": [goal("pipeline efficiency", 0.957, at_least=0.95), goal("ratio", 1.3, at_most=1.2)],
        "notes": ["a note"],
    }
    return BenchResult(
        name="demo", config={"seconds": 2.0, "device": "cpu"}, rows=rows, summary=summary, chart=chart
    )


def test_goal_checks_both_directions_and_unmeasured():
    assert goal("a", 0.96, at_least=0.95)["met"] and not goal("a", 0.94, at_least=0.95)["met"]
    assert goal("b", 1.1, at_most=1.2)["met"] and not goal("b", 1.3, at_most=1.2)["met"]
    assert not goal("c", None, at_least=0.5)["met"]
    with pytest.raises(ValueError, match="exactly one"):
        goal("d", 1.0)


def test_provenance_names_machine_and_versions():
    p = provenance()
    assert p["versions"]["torch"] and p["versions"]["dflash-pipe"]
    assert p["cpu_count"] >= 1 and p["hostname"] and p["python"].count(".") == 2
    assert p["gpu_count"] == len(p["gpus"])
    assert p["git_sha"] is None or len(p["git_sha"].removesuffix("-dirty")) == 40


@pytest.mark.parametrize("kind", ["bar", "line"])
def test_save_writes_json_that_round_trips_and_a_png(tmp_path: Path, kind: str):
    result = _result(kind)
    paths = save_result(result, tmp_path / "out")
    assert paths["json"] == tmp_path / "out" / "demo.json"
    back, prov = load_result(paths["json"])
    assert back == result
    assert prov["versions"]["torch"] and "timestamp" in prov
    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_non_finite_figures_become_null(tmp_path: Path):
    result = _result()
    result.rows[0]["tokens_per_s"] = float("nan")
    data = json.loads(save_result(result, tmp_path)["json"].read_text())
    assert data["rows"][0]["tokens_per_s"] is None


def test_load_refuses_other_json(tmp_path: Path):
    path = tmp_path / "x.json"
    path.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not a bench result"):
        load_result(path)


def test_show_prints_rows_summary_and_verdicts():
    console = Console(record=True, width=200)
    show_result(_result(), console)
    text = console.export_text()
    for figure in (
        "12,346",
        "6,789",
        "6,500",
        "producer alone",
        "pipeline_efficiency: 0.957",
        "note: a note",
    ):
        assert figure in text, figure
    assert "goal pipeline efficiency: 0.957 (goal >= 0.95): met" in text
    assert "goal ratio: 1.30 (goal <= 1.2): not met" in text


def test_a_wide_table_in_a_log_keeps_every_figure():
    """Not a terminal, 80 columns: rich would squeeze 18 columns into ellipses; the log keeps them whole."""
    columns = [f"figure_{i}" for i in range(18)]
    result = BenchResult(
        name="wide", config={}, rows=[{c: f"value-{i}" for i, c in enumerate(columns)}], summary={}
    )
    console = Console(record=True, width=80, force_terminal=False)
    show_result(result, console)
    text = console.export_text()
    for i, column in enumerate(columns):
        assert column in text and f"value-{i}" in text, column
    assert "…" not in text
    assert console.width == 80
