"""bench/draft_graphs.py on CPU, on a tiny target written here: every row is measured and the graphed buffers
draft what the step-by-step forward drafts at every compared step (the GPU run captures the graphs)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import tiny_qwen3_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_draft_graphs_bench_measures_both_kinds_and_compares_drafts(tmp_path):
    tiny_qwen3_config(num_hidden_layers=8, vocab_size=64, max_position_embeddings=256).save_pretrained(
        tmp_path / "target"
    )
    done = subprocess.run(
        [sys.executable, "bench/draft_graphs.py", "--target-config", str(tmp_path / "target"),
         "--out", str(tmp_path / "out"), "--prompts", "1", "--prompt-tokens", "12", "--max-new-tokens", "20",
         "--draft-layers", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "out" / "draft_graphs.json").read_text())
    kinds = {row["kind"]: row for row in result["rows"]}
    assert set(kinds) == {"graphed (SDPA)", "step by step, SDPA"}  # no flex row without CUDA
    for row in kinds.values():
        assert row["steps"] >= 2 and row["draft_ms_per_step"] > 0 and row["greedy_tokens_per_s"] > 0
    assert result["summary"]["steps_compared"] > 0
    assert result["summary"]["graphed_drafts_differing"] == 0
