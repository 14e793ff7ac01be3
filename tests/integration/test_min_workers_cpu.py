"""``--min-workers`` in a live CPU run: a count that never comes stops the run with a line naming the flag
(no silent wait), the resumed launch counts again, and the count a worker attaching brings opens the gate."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_elastic_cpu import ResumedRun, attach, rows, wait_for_row
from test_faults_cpu import LiveRun

from tests.launch_flags import demo_subset

pytestmark = pytest.mark.slow

JOIN_TIMEOUT_S = 40
"""The run's ``wire.join_timeout_s``, which its resume keeps: the first launch waits it out, and the worker
attached to the resume must start and join within it (with this file running twice at once on 2 cores, one
said HELLO 17 s after its start and was not in the group when a 20 s wait ran out). 8x the peer timeout: a
waiting worker keeps beating, so it is not dropped as silent meanwhile."""


def test_min_workers_never_reached_stops_the_run_then_a_resume_waits_again_until_a_worker_attaches(
    tmp_path: Path,
):
    """About 110 s, most of it waiting (~40 s of CPU): the run must wait out a real join timeout
    (``JOIN_TIMEOUT_S``), then a resume waits again until a worker is attached by hand and trains (three
    processes' start-ups in turn)."""
    data = demo_subset(tmp_path / "data.jsonl", 80)
    config = tmp_path / "short_wait.yaml"
    config.write_text(f"wire:\n  join_timeout_s: {JOIN_TIMEOUT_S}\n")
    args = ["--config", str(config), "--workers", "1", "--data", str(data), "--epochs", "1"]
    run = LiveRun(tmp_path / "run", *args, "--eval-samples", "4", "--min-workers", "2", "--peer-timeout", "5")
    t0 = time.monotonic()
    rc, out = run.finish(timeout=180)
    stopped_s = time.monotonic() - t0
    assert rc != 0, out
    assert "waiting for 2 workers (1 in) before the first step (--min-workers 2)" in out, out
    assert f"--min-workers 2: only 1 worker(s) joined the drafters' group within {JOIN_TIMEOUT_S} s" in out, (
        out
    )
    assert not [r for r in rows(run.run_dir) if "loss" in r]  # not one step at world 1
    assert "silent" not in out, out
    log = (run.run_dir / "logs" / "worker0.log").read_text()
    assert log.count("waiting for 2 workers (1 in)") == 1, log

    before = len(rows(run.run_dir))
    resumed = ResumedRun(run.run_dir)  # the saved --min-workers 2: it waits again
    resumed.wait_for(r"waiting for 2 workers \(1 in\)")
    address = resumed.wait_for(r"producer at (tcp://\S+?),").group(1)
    extra = attach(address, "attached", tmp_path / "attached.log")
    try:
        first = wait_for_row(resumed, lambda r: "loss" in r, timeout=120, skip=before)
        rc, out = resumed.finish(timeout=180)
        assert rc == 0, out
        assert extra.wait(timeout=60) == 0, (tmp_path / "attached.log").read_text()
    finally:
        if extra.poll() is None:
            extra.kill()
    assert first["world_size"] == 2 and "training started" in out, (first, out)
    print(
        f"\nFIGURES min-workers: a count never reached stopped the run {stopped_s:.0f} s after its start (join "
        f"timeout {JOIN_TIMEOUT_S} s); the resumed launch waited again and took its first step at world {first['world_size']:.0f}"
    )
