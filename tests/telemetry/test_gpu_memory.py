"""GPU memory joins the producer's records; CPU devices add nothing and torch is never imported for it."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_pipe.telemetry import GpuMemoryProbe, make_logger


def test_cpu_devices_add_nothing(tmp_path: Path):
    probe = GpuMemoryProbe(["cpu", "cpu"])
    assert not probe and probe.probe() == {}
    with make_logger(tmp_path / "metrics.jsonl", gpu_devices=["cpu"]) as logger:
        logger.log({"loss": 1.0}, 1)
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert set(record) == {"step", "time", "loss"}


def test_probe_values_join_every_record(tmp_path: Path, monkeypatch):
    probe = GpuMemoryProbe(["cuda:0", "cuda:5", "cuda:0", "cpu"])
    assert probe.devices == ["cuda:0", "cuda:5"]
    monkeypatch.setattr(probe, "probe", lambda: {"gpu_mem_used_gib/cuda:0": 12.5})
    from dflash_pipe.telemetry import JsonlSink, MetricsLogger

    with MetricsLogger([JsonlSink(tmp_path / "m.jsonl")], extra=probe.probe) as logger:
        logger.log({"loss": 2.0}, 3)
    record = json.loads((tmp_path / "m.jsonl").read_text())
    assert record["gpu_mem_used_gib/cuda:0"] == 12.5 and record["loss"] == 2.0
