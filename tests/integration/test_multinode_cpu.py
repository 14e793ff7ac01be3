"""Two simulated nodes on this host: the run's coordinator (``launch``) with its workers, and a second
producer attached with ``dflash-pipe producer --connect`` with its own workers, its processes marked as
another node (``DFLASH_PIPE_NODE``: no ring between the nodes, features counted as crossing the network).

What the ledger and metrics.jsonl must say: every sample of the epoch trained exactly once across both
producers, no feature byte between the nodes (only plans' tokens), after the second node's producer
and workers are SIGKILLed mid-epoch, nothing lost, and a worker of the second node pointed at the
coordinator is sent to its own node's producer (REDIRECT). Each test prints its figures (``-s``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_elastic_cpu import final_ledger, rows, wait_for_a_whole_epoch, wait_for_row
from test_faults_cpu import ROOT, LiveRun, worker_pid

from tests.launch_flags import demo_subset

pytestmark = pytest.mark.slow

EPOCHS = 6
"""Six epochs of 240 samples at LiveRun's sizes: ~270 steps with one worker a node (~60 s on 2 idle cores),
which the second node (a producer and its worker starting) joined by step ~66: time for it to join, train
and be killed, with steps to spare on a loaded machine, where its start-up slows as the steps do."""
REDIRECT_EPOCHS = 50
"""More than the redirect test ever trains: it stops the run with Ctrl-C once an epoch was trained whole by
its three workers."""


def attach_node(address: str, name: str, log: Path, workers: int = 2) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env["DFLASH_PIPE_NODE"] = name
    cmd = [sys.executable, "-m", "dflash_pipe", "producer", "--connect", address, "--device", "cpu"]
    cmd += ["--workers", str(workers), "--name", name]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def node_worker(address: str, name: str, node: str, log: Path) -> subprocess.Popen:
    """``dflash-pipe worker --connect ADDRESS`` started by hand on the simulated node ``node``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env["DFLASH_PIPE_NODE"] = node
    cmd = [sys.executable, "-m", "dflash_pipe", "worker", "--connect", address, "--device", "cpu"]
    cmd += ["--name", name, "--reconnect-timeout", "5"]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def last(run_dir: Path, key: str) -> float:
    return max((r[key] for r in rows(run_dir) if key in r), default=0.0)


def test_two_nodes_train_every_sample_once_features_stay_home_and_a_stray_worker_is_redirected(
    tmp_path: Path,
):
    """About a minute and a half: two "nodes" (a producer and one worker each), and a third worker started by
    hand on node1 with the coordinator's address, train one run together. The coordinator redirects that
    worker to node1's producer; an epoch trained from start to end by all three holds every sample exactly
    once across both producers; no feature byte crosses between the nodes (only plans' tokens); and a Ctrl-C
    on the coordinator then drains all five processes to exit 0. One run for the three claims: each launch
    of five processes costs a minute and a half of two shared cores."""
    data = demo_subset(tmp_path / "data.jsonl", 240)
    args = ["--data", str(data), "--workers", "1", "--epochs", str(REDIRECT_EPOCHS), "--eval-samples", "4"]
    run = LiveRun(tmp_path / "run", *args, "--checkpoint-every", "100000")
    address = run.wait_for(r"producer at (tcp://\S+?),").group(1)
    node = attach_node(address, "node1", tmp_path / "node1.log", workers=1)
    extra: subprocess.Popen | None = None
    log = tmp_path / "extra.log"
    try:
        wait_for_row(run, lambda r: r.get("world_size") == 2, timeout=180)  # node1 serves (it welcomed one)
        extra = node_worker(address, "extra", "node1", log)
        joined = wait_for_row(run, lambda r: r.get("world_size") == 3, timeout=180)
        whole = wait_for_a_whole_epoch(run, REDIRECT_EPOCHS)  # trained by all three from start to end
        run.proc.send_signal(signal.SIGINT)
        rc, out = run.finish(timeout=180)
        assert rc == 0, out
        assert node.wait(timeout=60) == 0, (tmp_path / "node1.log").read_text()
        assert extra.wait(timeout=60) == 0, log.read_text()
    finally:
        for proc in (node, extra):
            if proc is not None and proc.poll() is None:
                proc.kill()
    step, ledger = final_ledger(run.run_dir)
    counts = [ledger.count(e) for e in range(whole + 1)]
    assert all(ledger.complete(e) for e in range(whole + 1)) and ledger.duplicates == 0, (
        whole,
        counts,
        ledger.duplicates,
    )
    node1_log, extra_log = (tmp_path / "node1.log").read_text(), log.read_text()
    assert "attached to run" in node1_log and "the coordinator said DONE" in node1_log, node1_log
    served_at = _served_at(tmp_path / "node1.log")
    assert (
        f"redirected by the coordinator to producer node1 at {served_at}: it runs on this node, so features "
        "stay here"
    ) in extra_log, extra_log
    assert last(run.run_dir, "workers_redirected") == 1.0
    assert last(run.run_dir, "time_to_first_step_s/extra") > 0  # its first step, reported by node1's producer
    assert "gets its features over the network" not in out + node1_log
    remote = [
        last(run.run_dir, k)
        for k in ("wire/feature_bytes_remote", "producer/node1/wire/feature_bytes_remote")
    ]
    node1_features = last(run.run_dir, "producer/node1/wire/feature_bytes_local")
    own_features = last(run.run_dir, "wire/feature_bytes_local") - node1_features
    plan_bytes = last(run.run_dir, "wire/plan_bytes")
    assert remote == [0.0, 0.0] and node1_features > 0 and own_features > 0, (remote, node1_features)
    assert 0 < plan_bytes < node1_features / 50  # tokens, not features, cross to the second node
    print(
        f"\nFIGURES two nodes and a redirected worker: world 3 from step {joined['step']}, epoch {whole} trained "
        f"whole by the three, steps {step}, samples per epoch {counts} of {ledger.num_samples}, duplicates "
        f"{ledger.duplicates}; feature bytes node0 local {own_features / 1e6:.1f} MB, node1 local "
        f"{node1_features / 1e6:.1f} MB, remote {remote[0]:.0f} (coordinator's links) and {remote[1]:.0f} "
        f"(node1's); plans {plan_bytes / 1e3:.0f} KB"
    )


def test_a_sigkilled_node_loses_nothing_and_the_run_finishes(tmp_path: Path):
    """About a minute: two "nodes" (a producer and one worker each) train together until one node is
    SIGKILLed; the run must wait out the peer timeout and finish the ``EPOCHS`` epochs on the other."""
    data = demo_subset(tmp_path / "data.jsonl", 240)
    args = ["--data", str(data), "--workers", "1", "--epochs", str(EPOCHS), "--eval-samples", "4"]
    args += ["--peer-timeout", "5"]
    run = LiveRun(tmp_path / "run", *args)
    address = run.wait_for(r"producer at (tcp://\S+?),").group(1)
    node = attach_node(address, "node1", tmp_path / "node1.log", workers=1)
    try:
        wait_for_row(run, lambda r: r.get("world_size") == 2, timeout=180)
        node_address = _served_at(tmp_path / "node1.log")
        pids = [worker_pid(node_address, "node1-worker0")]
        before = len(rows(run.run_dir))
        node.kill()  # the node's producer first, then its workers: a lost node
        node.wait()
        t0 = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        regrouped = wait_for_row(
            run, lambda r: r.get("world_size") == 1 and "generation" in r, timeout=180, skip=before
        )
        recover_s = time.monotonic() - t0
        rc, out = run.finish(timeout=240)
        assert rc == 0, out
    finally:
        if node.poll() is None:
            node.kill()
    assert "producer node1" in out and "warning" in out, out
    step, ledger = final_ledger(run.run_dir)
    released = last(run.run_dir, "released_samples")
    assert all(ledger.complete(e) for e in range(EPOCHS)), [ledger.count(e) for e in range(EPOCHS)]
    assert ledger.duplicates <= released, (ledger.duplicates, released)
    print(
        f"\nFIGURES node SIGKILL: group of 1 again {recover_s:.1f} s after its workers were killed (step "
        f"{regrouped['step']}), steps {step}, samples lost {EPOCHS * ledger.num_samples - ledger.total_trained()}, "
        f"duplicates {ledger.duplicates} (given back: {released:.0f} samples)"
    )


def _served_at(log: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if "serving them at " in line:
                return line.rsplit("serving them at ", 1)[1].strip()
        time.sleep(0.2)
    raise AssertionError(log.read_text())


# --- issue 31: two nodes train like one ----------------------------------------------------------------------

CURVE_SAMPLES = 160
CURVE_EPOCHS = 2
CURVE_SIZES = ("--max-length", "256")
"""The demo's drafter (3 layers, 32 anchors) on samples of up to 256 tokens, not LiveRun's small sizes: the
noise below was measured at these, and the one-layer drafter of 8 anchors draws another curve (one run: 69
steps, late mean 3.83, against 42 steps and 3.19-3.41 here)."""
CURVE_ARGS = ("--token-budget", "256", "--min-workers", "4")
"""Small batches (1-4 samples): about 42 steps of four workers over 2 epochs of 160 samples, ~35 s a run."""
WINDOWS = 4
STEP_SLACK = 4
"""Steps may differ a little: a step where a worker has no batch yet trains fewer samples (measured: one node
42 steps in 6 runs of 6, two nodes 41 in 2 of 2; the world-2 start took 55 and 81)."""
LOSS_TOLERANCE = 0.3
"""The noise of the late mean loss, measured (see the test's docstring): 0.215 between the farthest of six
one-node runs; 0.3 leaves a margin for a loaded CI machine."""
KNEE_LOSS = 5.0
KNEE_TOLERANCE = 0.035
"""The noise of the share of samples trained when the loss first falls below ``KNEE_LOSS``: 0.112-0.138 in
the six one-node runs (0.026); a world-2 start gets there on 0.067-0.074 (more updates per sample)."""


def one_node(tmp_path: Path, data: Path, *args: str) -> LiveRun:
    """``launch`` of CPU workers (four unless ``args`` say otherwise), a loss row at every step."""
    config = tmp_path / "log_every_step.yaml"
    config.write_text("train:\n  log_every: 1\n")
    return LiveRun(
        tmp_path / "run",
        "--config",
        str(config),
        "--workers",
        "4",
        "--data",
        str(data),
        "--epochs",
        str(CURVE_EPOCHS),
        "--eval-samples",
        "4",
        *args,
        sizes=CURVE_SIZES,
    )


def two_nodes(tmp_path: Path, data: Path, *args: str) -> tuple[LiveRun, subprocess.Popen]:
    """The coordinator with two workers and an attached producer with two more."""
    run = one_node(tmp_path, data, "--workers", "2", *args)
    address = run.wait_for(r"producer at (tcp://\S+?),").group(1)
    return run, attach_node(address, "node1", tmp_path / "node1.log")


def finish(run: LiveRun, node: subprocess.Popen | None = None, log: Path | None = None) -> str:
    try:
        rc, out = run.finish(timeout=300)
        assert rc == 0, out
        if node is not None:
            assert node.wait(timeout=60) == 0, log.read_text() if log else ""
    finally:
        if node is not None and node.poll() is None:
            node.kill()
    return out


def curve(run_dir: Path) -> list[dict]:
    """One row per step with its loss, progress (the share of all planned samples trained) and world size."""
    by_step = {r["step"]: r for r in rows(run_dir) if "loss" in r}
    return [by_step[s] for s in sorted(by_step)]


def window_means(points: list[dict], windows: int = WINDOWS) -> list[float]:
    """Mean loss of the steps in each of ``windows`` equal slices of the run's progress (samples trained,
    not steps: a step of fewer batches is a smaller part of the run)."""
    sums, counts = [0.0] * windows, [0] * windows
    for r in points:
        i = min(int(r["progress"] * windows), windows - 1)
        sums[i] += r["loss"]
        counts[i] += 1
    return [s / max(c, 1) for s, c in zip(sums, counts, strict=True)]


def knee(points: list[dict], level: float = KNEE_LOSS) -> float:
    """The progress (share of the run's samples) at the first step whose loss is below ``level``: how much
    data the fall from ~19 took, which more updates per sample early (a partial group) shortens."""
    return next((r["progress"] for r in points if r["loss"] < level), 1.0)


def late_mean(windows: list[float]) -> float:
    """The mean of every window but the first: the first holds the fall from ~19 to ~4 in a handful of
    steps, where a step more or less moves the mean by a whole unit of loss (0.96 between one-node runs)."""
    return sum(windows[1:]) / len(windows[1:])


def test_two_nodes_with_min_workers_train_like_one_node(tmp_path: Path):
    """Issue 31: two "nodes" (a producer and two workers each) train one drafter like one node of four
    workers on the same data, seed and epochs, because ``--min-workers 4`` holds the first step until all
    four are in. The data order is the same in both: the coordinator plans every batch from the seed
    (``producer.scheduler``) and leases plans to the attached producer; which four batches make one step
    depends on timing, in one node as in two.

    Noise, measured on this 2-core machine (2026-12-05, 160 samples, 2 epochs, token budget 256;
    ``bench/multinode_curves.py`` reruns it): six
    one-node runs of four workers (seed 0 three times, seeds 1, 2, 3) took 42 steps each; the loss first fell
    below 5 at progress 0.112-0.138 (the knee); their window means over progress quarters spread 7.82-8.78,
    3.56-3.74, 3.09-3.37, 2.92-3.11, and the late mean (quarters 2-4) 3.19-3.41: 0.215 between the farthest
    two. ``KNEE_TOLERANCE`` and ``LOSS_TOLERANCE`` are set from these spreads. Six two-node runs with
    --min-workers 4: 41 steps, knee 0.119, late means 3.20-3.43; in the four runs of this test, the gap to
    its one-node run was 0.010, 0.188, 0.144 and 0.006. Without --min-workers (the old start: world 1 or 2
    until node1 joined) four runs took 55, 56, 58 and 81 steps, knee 0.067-0.074, late means 2.76-3.06: the
    world size, the step count and the knee fail all four; the late mean alone fails only the longest (the
    runs of 56 and 58 steps were 0.226 and 0.278 below their one-node run, inside the bound)."""
    data = demo_subset(tmp_path / "data.jsonl", CURVE_SAMPLES)
    t0 = time.monotonic()
    (tmp_path / "one").mkdir()
    one = one_node(tmp_path / "one", data, *CURVE_ARGS)
    finish(one)
    one_s = time.monotonic() - t0
    (tmp_path / "two").mkdir()
    two, node = two_nodes(tmp_path / "two", data, *CURVE_ARGS)
    out = finish(two, node, tmp_path / "two" / "node1.log")
    total_s = time.monotonic() - t0
    a, b = curve(one.run_dir), curve(two.run_dir)
    assert a and b
    assert {r["world_size"] for r in a} == {4.0} and {r["world_size"] for r in b} == {4.0}  # no step before
    assert "waiting for 4 workers" in out, out  # the coordinator's log said what it waited for
    wa, wb = window_means(a), window_means(b)
    gap = abs(late_mean(wa) - late_mean(wb))
    print(
        f"\nFIGURES two nodes vs one (--min-workers 4): steps {len(a)} vs {len(b)}; loss below {KNEE_LOSS} at "
        f"progress {knee(a):.3f} vs {knee(b):.3f} (noise bound {KNEE_TOLERANCE}); loss by progress quarter "
        f"{' '.join(f'{x:.3f}' for x in wa)} vs {' '.join(f'{x:.3f}' for x in wb)}; late mean "
        f"{late_mean(wa):.3f} vs {late_mean(wb):.3f} (gap {gap:.3f}, noise bound {LOSS_TOLERANCE}); final "
        f"loss {a[-1]['loss']:.3f} vs {b[-1]['loss']:.3f}; one node {one_s:.0f} s, both {total_s:.0f} s"
    )
    assert abs(len(a) - len(b)) <= STEP_SLACK, (len(a), len(b))
    assert abs(knee(a) - knee(b)) <= KNEE_TOLERANCE, (knee(a), knee(b))
    assert gap <= LOSS_TOLERANCE, (wa, wb)
