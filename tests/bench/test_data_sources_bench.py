"""bench/data_sources.py on a few conversations, in-process: the parquet and JSONL it writes hold the same
conversations, and every case (stored, store reused, in memory) measures the same samples (the subprocess
driver is the 1M run's)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.bench.helpers import ROOT

pytest.importorskip("datasets")

_spec = importlib.util.spec_from_file_location("data_sources", ROOT / "bench" / "data_sources.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_both_cases_measure_the_same_samples(tmp_path):
    jsonl, parquet = bench.write_data(tmp_path, 30, seed=1, row_group=7)
    args = bench.parse_args(["--conversations", "30"])
    rows = {
        case: bench.measure(case, jsonl if case.startswith("jsonl") else parquet, args)
        for case in bench.CASES + bench.IN_MEMORY
    }
    assert rows["jsonl"]["rows"] == rows["parquet"]["rows"] == 30
    digests = {case: r["digest"] for case, r in rows.items() if "digest" in r}
    assert len(digests) == 6 and len(set(digests.values())) == 1  # stored, reused, in memory: same samples
    assert rows["jsonl"]["store_mib"] > 0 and rows["jsonl in memory"]["store_mib"] is None
    assert rows["jsonl read only"]["rows"] == rows["parquet read only"]["rows"] == 30
    assert all(r["peak_rss_mib"] >= r["rss_before_mib"] > 0 and r["seconds"] > 0 for r in rows.values())
