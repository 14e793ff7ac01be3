"""Which devices the target and the drafter workers use: parsing and validating GPU specs."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Literal

from dflash_pipe.fields import check_choice, flag

_SPEC = re.compile(r"^\d+(-\d+)?$")


def _spec(ids: tuple[int, ...]) -> str:
    return ",".join(map(str, ids)) or "(none)"


def parse_gpu_spec(spec: str, *, flag: str = "--gpus") -> tuple[int, ...]:
    """'0-4' -> (0,1,2,3,4); '0,2,5-7' -> (0,2,5,6,7). Order kept, duplicates rejected."""
    ids: list[int] = []
    parts = [p.strip() for p in str(spec).split(",")]
    if not spec or not all(parts):
        raise ValueError(f"{flag} {spec!r}: empty GPU list. Use ids and ranges such as '0-4' or '5,6,7'.")
    for part in parts:
        if not _SPEC.match(part):
            raise ValueError(f"{flag} {spec!r}: {part!r} is not a GPU id or a range like '0-4'.")
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-"))
            if hi < lo:
                raise ValueError(f"{flag} {spec!r}: range {part!r} runs backwards; write '{hi}-{lo}'.")
            ids.extend(range(lo, hi + 1))
        else:
            ids.append(int(part))
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ValueError(f"{flag} {spec!r}: GPU ids {dupes} appear more than once.")
    return tuple(ids)


@dataclass(kw_only=True, slots=True)
class LayoutConfig:
    device: Literal["cuda", "cpu"] = field(
        default="cuda",
        metadata=flag(
            "--device",
            "auto: CUDA if a GPU is visible, else CPU.",
            resume=True,
            choices=("auto", "cuda", "cpu"),
            default="auto",
        ),
    )
    target_gpus: tuple[int, ...] = field(
        default=(),
        metadata=flag("--target-gpus", "GPUs of the target replicas, e.g. 0-4 or 0,1.", resume=True),
    )
    """CUDA devices of the producer's target replicas (one replica per GPU)."""
    drafter_gpus: tuple[int, ...] = field(
        default=(),
        metadata=flag(
            "--drafter-gpus", "GPUs of the drafter workers (one process each), e.g. 5-7.", resume=True
        ),
    )
    """CUDA devices of the drafter workers (one worker process per GPU)."""
    cpu_workers: int = field(
        default=2, metadata=flag("--workers", "Number of drafter workers on CPU.", resume=True, default=2)
    )
    """Number of drafter workers when device is cpu."""
    target_parallel: Literal["auto", "replicas", "split"] = field(
        default="auto",
        metadata=flag(
            "--target-parallel",
            "One target replica per GPU, or one replica split by layers across the target GPUs (auto: "
            "replicas when the weights fit one GPU).",
            resume=True,
        ),
    )
    """One target replica per GPU (fits), one replica split by layers over all target GPUs, or auto."""
    drafter_mode: Literal["processes", "threads"] = field(
        default="processes",
        metadata=flag(
            "--drafter-mode",
            "One worker process per drafter device (default), or one process with a drafter thread per "
            "device.",
            resume=True,
        ),
    )
    """One worker process per drafter device, or one worker process running a drafter thread per device
    (one CUDA context; compiles serialised by a process-wide lock)."""

    def __post_init__(self) -> None:
        self.target_gpus = tuple(self.target_gpus)
        self.drafter_gpus = tuple(self.drafter_gpus)
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}.")
        if self.device == "cuda" and (not self.target_gpus or not self.drafter_gpus):
            raise ValueError("On CUDA both --target-gpus and --drafter-gpus are needed (e.g. 0-4 and 5-7).")
        check_choice(self, "target_parallel", "--target-parallel")
        check_choice(self, "drafter_mode", "--drafter-mode")
        if self.cpu_workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.cpu_workers}.")

    @property
    def num_workers(self) -> int:
        """Drafters trained together (one per drafter device), whatever the drafter mode."""
        return len(self.drafter_gpus) if self.device == "cuda" else self.cpu_workers

    def worker_processes(self) -> list[list[str]]:
        """The devices of each worker process: one each, or all of them in one process (threads)."""
        devices = self.worker_devices()
        return [devices] if self.drafter_mode == "threads" else [[d] for d in devices]

    def worker_devices(self) -> list[str]:
        if self.device == "cpu":
            return ["cpu"] * self.cpu_workers
        return [f"cuda:{i}" for i in self.drafter_gpus]

    def target_devices(self) -> list[str]:
        return ["cpu"] if self.device == "cpu" else [f"cuda:{i}" for i in self.target_gpus]

    def validate_against(self, device_count: int) -> None:
        """Checks the GPU ids exist on this machine."""
        if self.device == "cpu":
            return
        if device_count == 0:
            import torch

            build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU-only build")
            raise ValueError(
                f"--target-gpus {_spec(self.target_gpus)} --drafter-gpus {_spec(self.drafter_gpus)}: no CUDA "
                f"GPU is visible here ({build}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r})."
                " Run where the GPUs are, or drop the GPU flags and pass --device cpu to train on the CPU."
            )
        for option, ids in (("--target-gpus", self.target_gpus), ("--drafter-gpus", self.drafter_gpus)):
            missing = [i for i in ids if i >= device_count]
            if missing:
                raise ValueError(
                    f"{option}: GPU ids {missing} do not exist; this machine has {device_count} "
                    f"(ids 0-{device_count - 1})."
                )

    def shared_gpus(self) -> list[int]:
        """GPUs hosting both the target and a drafter worker (allowed: they share memory and compute)."""
        return sorted(set(self.target_gpus) & set(self.drafter_gpus)) if self.device == "cuda" else []
