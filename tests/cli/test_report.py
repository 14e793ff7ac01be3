"""`dflash-pipe report` on a real CPU demo run: PNG curves and the summary table, finished or running."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_pipe.cli import main
from tests.launch_flags import SMALL_RUN, demo_subset

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PNGS = ("loss.png", "accuracy.png", "tau.png", "throughput.png")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    """A real 12-step demo launch, once for the module: the report reads what a run writes. Its regeneration
    and real eval run as in the demo (the report has their rows to show), at SMALL_RUN's sizes on 200 of the
    demo's conversations, with 4 real-eval prompts: the report plots whatever values a run logs."""
    tmp = tmp_path_factory.mktemp("report")
    run_dir, data = tmp / "run", demo_subset(tmp / "demo200.jsonl", 200)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "dflash_pipe", "launch", "--device", "cpu", "--max-steps", "12", "--plain"]
    cmd += ["--data", str(data), *SMALL_RUN, "--eval-prompts", "4"]
    out = subprocess.run(
        [*cmd, "--run-dir", str(run_dir)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return run_dir


def test_report_writes_pngs_and_the_summary(demo_run: Path):
    result = CliRunner().invoke(main, ["report", str(demo_run)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    for name in PNGS:
        png = demo_run / "report" / name
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "loss" in result.output and "tau" in result.output and "tokens/s" in result.output
    assert "wrote" in result.output and "time to first step" in result.output


def test_report_on_a_running_run(demo_run: Path, tmp_path: Path):
    # A run still writing: the last record is cut short. It is skipped, the rest is plotted.
    running = tmp_path / "running"
    running.mkdir()
    text = (demo_run / "metrics.jsonl").read_text()
    (running / "metrics.jsonl").write_text(text + '{"step": 13, "time": 1.0, "lo')
    result = CliRunner().invoke(main, ["report", str(running), "--out", str(tmp_path / "png")])
    assert result.exit_code == 0, result.output
    assert all((tmp_path / "png" / name).exists() for name in PNGS)


def test_report_on_a_run_with_no_metrics_yet(tmp_path: Path):
    (tmp_path / "metrics.jsonl").write_text("")
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert all((tmp_path / "report" / name).exists() for name in PNGS)
    result = CliRunner().invoke(main, ["report", str(tmp_path / "report")])
    assert result.exit_code == 1 and "metrics.jsonl does not exist" in result.output
