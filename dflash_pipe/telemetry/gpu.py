"""GPU memory of a run's devices, read by the producer and added to its metrics records.

Device-wide used memory comes from NVML (``torch.cuda.device_memory_used``, which needs nvidia-ml-py; no
CUDA context is created, so the producer can read the drafter GPUs too). Without NVML, only the devices this
process already uses (the target's) are reported, as torch's reserved memory. CPU devices are skipped.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

GIB = 2**30


class GpuMemoryProbe:
    """``probe()`` -> ``{"gpu_mem_used_gib/cuda:N": ...}`` (NVML) or ``{"gpu_mem_reserved_gib/cuda:N": ...}``."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = [d for d in dict.fromkeys(devices) if str(d).startswith("cuda")]
        self._nvml = True

    def __bool__(self) -> bool:
        return bool(self.devices)

    def probe(self) -> dict[str, float]:
        torch = sys.modules.get("torch")  # never import torch (or touch CUDA) just to log
        if torch is None or not self.devices:
            return {}
        out: dict[str, float] = {}
        for device in self.devices:
            if self._nvml:
                try:
                    out[f"gpu_mem_used_gib/{device}"] = torch.cuda.device_memory_used(device) / GIB
                    continue
                except Exception:  # no nvidia-ml-py, no driver: fall back for good
                    self._nvml = False
            if torch.cuda.is_initialized():
                out[f"gpu_mem_reserved_gib/{device}"] = torch.cuda.memory_reserved(device) / GIB
        return out
