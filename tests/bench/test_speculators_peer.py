"""The speculators peer end to end on CPU (``bench/peers/speculators_dflash.py``): a tiny random target over
the demo tokenizer, the demo rows, speculators' own trainer for 4 steps, a checkpoint at a mark and at the
end, each exported, and the final export speculating losslessly through dflash-pipe's own evaluation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_pipe.bench import real_model
from dflash_pipe.data import demo_data_path
from tests.real.speculators_site import RegistryUnreachable, speculators_site
from tests.tiny_models import save_demo_target

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site() -> Path:
    try:
        return speculators_site()
    except RegistryUnreachable as e:
        pytest.skip(f"package index unreachable, so speculators cannot be installed: {e}")


@pytest.mark.slow
def test_peer_trains_exports_and_its_export_speculates_losslessly(site, tmp_path):
    target = tmp_path / "target"
    save_demo_target(target, tie_word_embeddings=True)
    out = tmp_path / "out"
    cmd = [sys.executable, "bench/peers/speculators_dflash.py", "--target", str(target),
           "--conversations", str(demo_data_path()), "--max-rows", "6", "--max-length", "128",
           "--rows", str(tmp_path / "rows.jsonl"), "--out", str(out), "--minutes", "2", "--save-at", "0.01",
           "--steps", "4", "--layers", "1", "--mask-token-id", "3", "--total-seq-len", "256",
           "--max-anchors", "16", "--loader-workers", "0", "--device", "cpu", "--slot-rows", "2"]  # fmt: skip
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    summary = json.loads((out / "speculators_summary.json").read_text())
    assert summary["steps"] == 4 and summary["rows_captured"] == 6 and summary["stopped_by"] == "steps"
    assert "--full-attention-indices" in summary["speculators_argv"]
    assert [c["step"] for c in summary["checkpoints"]] == [1, 4]  # the mark (passed during capture), the end
    assert len(summary["slot_accuracy"]["per_slot"]) == 15
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]

    final = Path(summary["checkpoints"][-1]["export"])
    config = json.loads((final / "config.json").read_text())
    assert config["layer_types"] == ["full_attention"] and config["dflash_config"]["mask_token_id"] == 3
    lines = demo_data_path().read_text().splitlines(keepends=True)
    (tmp_path / "eval.jsonl").write_text("".join(lines[-2:]))
    rows = real_model.evaluate_drafters(
        target,
        {"speculators-final": final},
        {"demo": tmp_path / "eval.jsonl"},
        device="cpu",
        max_new_tokens=8,
        max_prompts=2,
    )
    assert len(rows) == 1 and rows[0]["drafter"] == "speculators-final"
    assert rows[0]["lossless_mismatches"] == 0, rows[0]
