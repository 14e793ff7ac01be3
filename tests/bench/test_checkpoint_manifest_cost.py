"""bench/checkpoint_manifest_cost.py on the demo shape: the real drafter's tensors, a verified checkpoint."""

from __future__ import annotations

import importlib.util
import json

from dflash_pipe.run import checkpoint as ck
from tests.bench.helpers import ROOT

_spec = importlib.util.spec_from_file_location(
    "manifest_cost", ROOT / "bench" / "checkpoint_manifest_cost.py"
)
manifest_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(manifest_cost)


def test_the_bench_saves_the_demo_drafters_checkpoint_and_times_the_manifest(tmp_path) -> None:
    result = manifest_cost.main(["--shape", "demo", "--out", str(tmp_path), "--big-mib", "4"])
    # the demo drafter by hand: fc [H, 3H], two norms, and per layer q/o [H, H], k/v [H/2, H], the q/k norms,
    # gate/up/down [384, H], two layer norms (H = 128)
    h, layer = 128, 2 * 128 * 128 + 2 * 64 * 128 + 2 * 32 + 3 * 384 * 128 + 2 * 128
    assert result["trainable_params"] == 3 * h * h + 2 * h + 3 * layer == 640_192
    assert result["bytes"][ck.DRAFTER_WEIGHTS] > 4 * 640_192  # fp32, plus the safetensors header
    assert set(result["bytes"]) == {*ck.REQUIRED_FILES, ck.MANIFEST}
    assert 0 < result["manifest_s"] < result["save_s"] and result["verify_s"] > 0
    assert result["big_file"]["1_thread_gb_per_s"] > 0
    saved = json.loads((tmp_path / "checkpoint_manifest_cost_demo.json").read_text())
    assert saved["trainable_params"] == result["trainable_params"]
