"""The recipe sweep's read-back (dflash_pipe/bench/sweep.py) on metrics files written here."""

from __future__ import annotations

import json

import pytest

from dflash_pipe.bench.sweep import sweep_row


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_row_averages_the_last_steps_and_keeps_the_final_simulated_tau(tmp_path):
    records = [{"step": 0, "time": 5.0, "warmup_s": 3.0}]  # a record without a loss is not a step
    for i in range(10):
        records.append({"step": 10 * (i + 1), "time": 10.0 + i, "loss": 10.0 - i, "acc": [0.1 * i, 0.05 * i]})
    records += [{"step": 100, "time": 20.0, "simulated/tau": 1.7, "final": 1.0}]
    row = sweep_row("lr2e-3", ["--lr", "2e-3"], _write(tmp_path / "m.jsonl", records), tail=0.2)
    assert row["steps"] == 100 and row["tail_steps"] == 2 and row["train_s"] == pytest.approx(9.0)
    assert row["loss"] == pytest.approx(1.5)  # steps 90 and 100: losses 2 and 1
    assert row["acc"] == pytest.approx([0.85, 0.425]) and row["acc_mean"] == pytest.approx(0.6375)
    assert row["simulated_tau"] == 1.7 and row["args"] == ["--lr", "2e-3"]


def test_a_run_that_never_trained_says_zero_steps(tmp_path):
    row = sweep_row("broken", [], tmp_path / "missing.jsonl")
    assert row == {"name": "broken", "args": [], "steps": 0}
    with pytest.raises(ValueError, match="tail"):
        sweep_row("x", [], tmp_path / "missing.jsonl", tail=0.0)
