"""`dflash-pipe bench compile` on CPU: cold, warm and N-together starts with the default warm-up (each)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.helpers import ON_EACH_DEVICE, read_result, run_bench

pytestmark = pytest.mark.slow


@ON_EACH_DEVICE
def test_compile_cold_warm_and_together(tmp_path: Path, device: str):
    """About 2 minutes: three real Inductor compiles of a drafter layer on CPU (two workers at once, then
    cold) and a warm start from the cold one's cache, because the claims are about real compiles. A cold
    worker's CPU goes mostly to g++ (a few s a kernel file) and AOT autograd, once per compiled variant.
    --warmup-batch-sizes 2 compiles one variant, not a worker's two (batch 1 is a second whole compile), and
    the suite's TORCHINDUCTOR_VEC_ISA_OK=0 (tests/conftest.py) compiles scalar kernels. Together they cut a
    cold worker from about 80 s of CPU to 37 s, and the test from 265 s of wall time to 117 s. --seq-len 96
    warms up at 96 and 48 tokens. Neither is a size of the demo drafter's weights: at 128, its hidden size,
    the first graph specialised the length to it."""
    out = tmp_path / "res"
    args = ["--device", device, "--workers", "2", "--seq-len", "96", "--draft-layers", "1"]
    args += ["--warmup-batch-sizes", "2"]
    done = run_bench("compile", *args, "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    data = read_result(out, "compile")
    assert data["config"]["warmup_batch_sizes"] == [2]
    assert data["config"]["cpu_simd"] is (False if device == "cpu" else None)  # tests/conftest.py's setting
    rows = {r["case"]: r for r in data["rows"]}
    cold, warm = rows["cold"], rows["warm"]
    together = [r for case, r in rows.items() if case.startswith("together")]
    assert len(together) == 2
    assert cold["compiled_here"] and not warm["compiled_here"]  # warm: the cold compile came from the cache
    # The default warm-up (each): every worker started together compiles, and none waits for a lock.
    assert all(r["compiled_here"] for r in together)
    assert all(r["waited_for_lock_s"] == 0 for r in together)
    s = data["summary"]
    assert "together_vs_cold" not in s  # that key is the once mode's, not asked for here
    assert s["together_each_vs_cold"] == pytest.approx(s["together_each_slowest_s"] / s["cold_s"], rel=0.01)
    assert s["goals"][0]["op"] == "<=" and s["goals"][0]["bound"] == 1.2
    cpu_note = any("compiles the drafter's decoder layers" in n for n in s["notes"])
    assert cpu_note == (device == "cpu")
    assert "cold_s" in done.stdout and "goal" in done.stdout
