"""One drafter per GPU: a second live worker on a GPU the run already trains on is refused before it joins
the group (NCCL would fail the whole group's init: "Duplicate GPU detected", seen on the H200), and a GPU
whose worker died is taken over. Checked on the run's real store (a TCPStore) with real processes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch.distributed as dist

from dflash_pipe.train.distributed import GpuTakenError, claim_gpu
from dflash_pipe.wire.shm import host_identity


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_a_gpu_held_by_a_live_worker_is_refused_and_a_dead_ones_is_taken_over(store) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        store.set("gpu-claims/GPU-1", f"{host_identity(simulated=False)}|{other.pid}|node1-worker0")
        with pytest.raises(GpuTakenError, match="worker node1-worker0 .* holds it.*another GPU"):
            claim_gpu(store, "GPU-1", "worker0")
    finally:
        other.kill()
        other.wait()
    claim_gpu(store, "GPU-1", "worker0")  # its holder is gone
    assert store.get("gpu-claims/GPU-1").decode().endswith("|worker0")
    claim_gpu(store, "GPU-1", "worker0")  # the same process again (a new group round): still its own
    claim_gpu(store, "GPU-2", "worker1")  # another GPU is free


def test_a_claim_whose_process_cannot_be_checked_from_here_is_taken_over(store) -> None:
    # another machine or pid namespace (a container): its pid means nothing here, as after a restart
    store.set("gpu-claims/GPU-3", "another-host/boot/1|1|far-worker")
    claim_gpu(store, "GPU-3", "worker0")
    assert store.get("gpu-claims/GPU-3").decode().endswith("|worker0")
