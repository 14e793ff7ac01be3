"""The attached-producer bench's phases: cut where the coordinator's count of attached producers changes,
the first seconds of each left out (sliding-window rates), supply = the coordinator's own + the attached."""

from __future__ import annotations

import json

from dflash_pipe.bench.attach import phases, read_rows


def record(t: float, attached: int, own: float, others: float, trained: float) -> dict:
    return {
        "step": int(t),
        "time": t,
        "producers_attached": attached,
        "tokens_per_s/producer": own,
        "tokens_per_s/attached_producers": others,
        "tokens_per_s": trained,
    }


def test_phases_split_where_producers_attach_and_skip_the_settling_window():
    rows = [record(t, 0, 100.0, 0.0, 90.0) for t in range(0, 30, 5)]
    rows += [record(30.0, 1, 100.0, 0.0, 95.0)]  # attached, not yet reporting: no supply record
    rows += [record(t, 1, 100.0 + t, 80.0, 170.0) for t in range(35, 70, 5)]
    rows += [{"step": 70, "time": 70.0, "loss": 3.0}]
    one, two = phases(rows, settle_s=10)
    assert (one.producers, one.start, one.seconds) == (1, 0, 30.0)
    assert one.records == 4 and one.supply_tokens_per_s == 100.0 and one.trained_tokens_per_s == 90.0
    # settled records of phase 2: t = 40..65 (30 and 35 are inside its first 10 s)
    assert (two.producers, two.start, two.seconds) == (2, 30.0, 40.0)
    assert two.records == 6
    assert two.supply_tokens_per_s == 100.0 + 52.5 + 80.0  # median of own 140..165 is 152.5
    assert two.trained_tokens_per_s == 170.0


def test_no_producer_records_no_phases_and_a_cut_line_is_skipped(tmp_path):
    assert phases([{"time": 1.0, "loss": 2.0}]) == []
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(record(0.0, 0, 1.0, 0.0, 1.0)) + "\n" + '{"step": 3, "ti')
    assert len(read_rows(path)) == 1
    assert read_rows(tmp_path / "missing.jsonl") == []
