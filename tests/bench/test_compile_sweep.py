"""bench/compile_sweep.py in its CPU mode: every compiled step equals the eager one (loss and gradients),
for all-full, block-10 and sliding+full drafters, built, warmed up and fed as a worker does, and the planned
batches after the warm-up recompile little."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from tests.bench.helpers import ROOT
from tests.drafter.conftest import tiny_drafter

pytestmark = pytest.mark.slow

SMALL = ("--max-anchors", "8", "--warmup-len", "256")
"""8 blocks a sample, not the CPU mode's 32, and a warm-up at 256 tokens (the CPU shapes' longest sample),
not a worker's 1024: the same graphs compile (the same warm-up, at lengths on both sides of the batches'),
but every step, compiled and eager, costs a fraction (a sliding+full case: 45 -> 24 s of CPU)."""


SWEEP_TIMEOUT_S = 1200
"""A cold Inductor cache (a fresh clone's) beside the other xdist worker: the sweep alone took 250 s cold, and
one run of the full suite needed more than 600 s for it."""


def run_sweep(out, *args: str) -> dict:
    done = subprocess.run(  # its own process: Dynamo's caches and counters stay out of this one
        [sys.executable, str(ROOT / "bench" / "compile_sweep.py"), "--cpu", *SMALL, *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=SWEEP_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "compile_sweep.json").read_text())


def test_cpu_sweep_compiled_equals_eager(tmp_path) -> None:
    """Minutes (alone on 2 cores: about 75 s on a warm Inductor cache, 250 s on a cold one): 3 drafter shapes x 2
    compile modes x 3 batch shapes, each case compiled for real (Dynamo reset) and every step checked against
    eager; three draws are the fewest that show a later batch reusing the compiled graph."""
    result = run_sweep(tmp_path, "--draws", "3")
    rows = result["rows"]
    assert {(r["shape"], r["mode"]) for r in rows} == {
        (shape, mode)
        for shape in ("tiny-full", "tiny-block10", "tiny-sliding")
        for mode in ("attention", "full")
    }
    assert not [r for r in rows if "error" in r]
    assert all(r["within_tolerance"] for r in rows), [(r["shape"], r["grad_rel_max"]) for r in rows]
    assert {r["block_size"] for r in rows} == {10, 16}
    assert any("sliding_attention" in r["layer_types"] for r in rows)
    for shape in ("tiny-full", "tiny-block10", "tiny-sliding"):
        for mode in ("attention", "full"):
            mine = sorted(
                (r for r in rows if (r["shape"], r["mode"]) == (shape, mode)), key=lambda r: r["draw"]
            )
            assert mine[0]["warmup_graphs"] > 0  # compiled for real: not eager against eager
            assert len({(r["batch"], r["padded_len"]) for r in mine}) >= 2  # batches of other shapes ...
            assert result["summary"][f"{shape}_{mode}_recompiling_draws"] <= 2  # ... few recompiles
    assert result["provenance"]["versions"]["torch"]


def test_long_run_in_parts_profiled_with_update(tmp_path) -> None:
    """What a device call of a long run does: resume the plan at a batch, no eager model, a kernel table,
    the weight update timed, MFU with it (None on CPU, where MFU is not measured). About 25 s of CPU, most
    of it the warm-up's real compile."""
    result = run_sweep(
        tmp_path,
        "--shapes",
        "tiny-sliding",
        "--modes",
        "full",
        "--draws",
        "4",
        "--first-draw",
        "2",
        "--reference-every",
        "0",
        "--profile",
    )
    rows = result["rows"]
    assert [r["draw"] for r in rows] == [2, 3]
    assert not [r for r in rows if "error" in r or "within_tolerance" in r]  # never checked: no eager model
    assert all(r["update_seconds"] > 0 for r in rows)
    table = (tmp_path / "profile_tiny-sliding_full.txt").read_text()
    assert table.startswith("draw 3 ") and "aten::mm" in table


def test_update_timed_after_a_failed_last_batch() -> None:
    """A run whose last batch ran out of memory (its zero_grad left no gradients) still times the update
    (an H200 run of the LLaMA-3.1-8B shape crashed there, losing its rows)."""
    spec = importlib.util.spec_from_file_location("compile_sweep", ROOT / "bench" / "compile_sweep.py")
    compile_sweep = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("compile_sweep", compile_sweep)  # its dataclasses look their module up
    spec.loader.exec_module(compile_sweep)
    model = tiny_drafter()
    model.zero_grad(set_to_none=True)
    assert compile_sweep.update_seconds(model, torch.device("cpu")) > 0
    assert all(p.grad is not None for p in model.trainable_parameters())
