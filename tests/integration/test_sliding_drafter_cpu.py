"""A mixed sliding/full drafter end to end on the demo: `launch --drafter-preset qwen3.6-27b` (window cut to 64
so it bites at 128-token samples, and 4 feature layers: the 6-layer demo target is too shallow for 5
distinct even-spread ones), export, and every loader check of tests/drafter/engine_loaders.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from transformers import Qwen3Config

from tests.drafter.engine_loaders import reference_loads, sglang_loads, vllm_loads
from tests.launch_flags import SMALL_BATCHES, demo_subset

SLIDING_THEN_FULL = [(64, True)] * 4 + [(None, False)]


def cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dflash_pipe", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_preset_drafter_trains_exports_and_loads_everywhere(tmp_path: Path) -> None:
    """About 30 s: a real launch with a sliding-window preset drafter (on 100 demo conversations' own replies:
    the drafter's layers are what is checked), its export, and the export loaded as vLLM's, SGLang's and the
    reference's loaders load it."""
    run_dir, exported = tmp_path / "run", tmp_path / "export"
    out = cli(
        "launch", "--plain", "--device", "cpu", "--workers", "1", "--run-dir", str(run_dir),
        "--drafter-preset", "qwen3.6-27b", "--sliding-window", "64", "--target-layer-ids", "1,2,3,4",
        "--max-steps", "3", *SMALL_BATCHES, "--eval-samples", "4", "--responses", "dataset",
        "--data", str(demo_subset(tmp_path / "data.jsonl", 100)),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    saved = json.loads((run_dir / "config.json").read_text())["drafter"]
    assert saved["preset"] == "qwen3.6-27b" and saved["layer_types"][-1] == "full_attention"
    out = cli("export", str(run_dir), str(exported))
    assert out.returncode == 0, out.stderr
    raw = json.loads((exported / "config.json").read_text())
    hf = Qwen3Config.from_pretrained(str(exported))
    tensors = load_file(str(exported / "model.safetensors"))
    got = vllm_loads(raw, hf, tensors)
    assert set(got["filled"]) == set(got["params"]) and got["attention"] == SLIDING_THEN_FULL
    got = sglang_loads(raw, hf, tensors)
    assert not got["ignored"] and set(got["filled"]) == set(got["params"])
    assert got["attention"] == SLIDING_THEN_FULL and got["target_layer_ids"] == [1, 2, 3, 4]
    got = reference_loads(hf)
    assert {k: tuple(t.shape) for k, t in tensors.items()} == got["params"]
    assert got["attention"] == SLIDING_THEN_FULL
