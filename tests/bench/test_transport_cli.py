"""`dflash-pipe bench transport` writes its JSON and PNG (the bench itself lives in bench/transport.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.bench.helpers import read_result, run_bench

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("dflash_pipe.bench.transport") is None,
        reason="dflash_pipe.bench.transport is not in this build yet (issue 11)",
    ),
]


def test_transport_cli_writes_results(tmp_path: Path):
    out = tmp_path / "res"
    done = run_bench(
        "transport", "--sizes-mib", "1,4", "--seconds", "0.5", "--device", "cpu", "--out", str(out)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data = read_result(out, "transport")
    assert data["name"] == "transport" and data["rows"]
    assert data["provenance"]["cpu_count"] >= 1
    assert "goal" in done.stdout
