"""GPU memory joins the producer's records; CPU devices add nothing and torch is never imported for it."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_pipe.telemetry import GpuMemoryProbe, make_logger
from dflash_pipe.telemetry.gpu import GIB


def test_cpu_devices_add_nothing(tmp_path: Path):
    probe = GpuMemoryProbe(["cpu", "cpu"])
    assert not probe and probe.probe() == {}
    with make_logger(tmp_path / "metrics.jsonl", gpu_devices=["cpu"]) as logger:
        logger.log({"loss": 1.0}, 1)
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert set(record) == {"step", "time", "loss"}


def test_nvml_memory_of_each_cuda_device_joins_every_record(tmp_path: Path, monkeypatch):
    """The probe's own logic around NVML: each cuda device once, bytes to GiB, read anew for every record."""
    import torch

    used = {"cuda:0": 12.5 * GIB, "cuda:5": 1.0 * GIB}
    asked: list[str] = []

    def device_memory_used(device):
        asked.append(device)
        return used[device]

    monkeypatch.setattr(torch.cuda, "device_memory_used", device_memory_used)
    devices = ["cuda:0", "cuda:5", "cuda:0", "cpu"]
    with make_logger(tmp_path / "m.jsonl", gpu_devices=devices) as logger:
        logger.log({"loss": 2.0}, 3)
        used["cuda:0"] = 13.0 * GIB
        logger.log({"loss": 1.5}, 4)
    first, second = (json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines())
    assert asked == ["cuda:0", "cuda:5"] * 2  # once per device and record, cpu skipped
    assert first["gpu_mem_used_gib/cuda:0"] == 12.5 and first["gpu_mem_used_gib/cuda:5"] == 1.0
    assert second["gpu_mem_used_gib/cuda:0"] == 13.0 and second["loss"] == 1.5


def test_without_nvml_it_falls_back_for_good_to_reserved_memory(monkeypatch):
    import torch

    calls: list[str] = []

    def no_nvml(device):
        calls.append(device)
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "device_memory_used", no_nvml)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: {"cuda:0": 2 * GIB}[device])
    probe = GpuMemoryProbe(["cuda:0"])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert probe.probe() == {}  # no CUDA context in this process: nothing to report, none created
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert probe.probe() == {"gpu_mem_reserved_gib/cuda:0": 2.0}
    assert probe.probe() == {"gpu_mem_reserved_gib/cuda:0": 2.0}
    assert calls == ["cuda:0"]  # NVML was tried once, not on every record
