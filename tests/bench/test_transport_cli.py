"""`dflash-pipe bench transport` writes its JSON and PNG (the bench itself lives in bench/transport.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.helpers import read_result, run_bench

pytestmark = pytest.mark.slow


def test_transport_cli_writes_results(tmp_path: Path):
    out = tmp_path / "res"
    done = run_bench(
        "transport", "--sizes-mib", "1,4", "--budget-mib", "16", "--device", "cpu", "--out", str(out)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data = read_result(out, "transport")
    assert data["name"] == "transport" and data["rows"]
    assert data["provenance"]["cpu_count"] >= 1
    assert "goal" in done.stdout
    paths = {r["path"] for r in data["rows"]}
    assert {"memcpy", "pyzmq 1 frame", "wire tcp", "wire ipc", "wire shm"} <= paths
    assert all(r["gb_per_s"] > 0 for r in data["rows"])
    assert data["summary"]["wire_vs_pyzmq_same_frames"] > 0
