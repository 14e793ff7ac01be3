"""bench/regenerate_speed.py in its CPU mode: rows, the HF cross-check and provenance in the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.bench.helpers import ROOT


@pytest.mark.slow
def test_cpu_mode_writes_rows_with_provenance(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "regenerate_speed.py"), "--device", "cpu", "--shapes", "demo"]
    cmd += ["--prompts", "4", "--batch-sizes", "1,4", "--hf-prompts", "2", "--new-tokens", "6"]
    cmd += ["--prompt-tokens", "24", "--launch-shapes", "none", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads((out / "regenerate_speed.json").read_text())
    assert data["name"] == "regenerate_speed" and data["provenance"]["versions"]["torch"]
    paths = [r["path"] for r in data["rows"]]
    assert paths == ["regeneration, batch 1", "regeneration, batch 4", "HF generate, one at a time"]
    batched = data["rows"][:2]
    assert all(0 < r["generated_tokens"] <= 4 * 6 and r["tokens_per_s"] > 0 for r in batched)
    assert batched[0]["generated_tokens"] == batched[1]["generated_tokens"]  # same replies at any batch size
    # greedy replies of the batched path equal HF generate's, prompt by prompt (fp32 on CPU)
    assert data["summary"]["demo_greedy_same_as_hf"] == "2/2"
    assert data["summary"]["demo_speedup_vs_hf"] > 0
