"""Run `dflash-pipe bench ...` in a subprocess, with this checkout first on the path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

ON_EACH_DEVICE = pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
        ),
    ],
)
"""Runs a bench test on CPU, and again on CUDA where a GPU is present."""


def run_bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "dflash_pipe", "bench", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def read_result(out: Path, name: str) -> dict:
    assert (out / f"{name}.png").stat().st_size > 5000
    return json.loads((out / f"{name}.json").read_text())
