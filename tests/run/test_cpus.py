"""CPU thread budgets follow the affinity mask (taskset, cgroups, Slurm), not the machine's core count."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dflash_pipe.cpus import threads_per_process, usable_cpus

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity API")


@needs_affinity
def test_usable_cpus_is_the_affinity_mask_of_a_pinned_child():
    """A child pinned to one core counts one, though the machine may have more (checked in a child so this
    process keeps its own mask)."""
    code = (
        "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
        "from dflash_pipe.cpus import usable_cpus, threads_per_process; "
        "print(usable_cpus(), threads_per_process(3), os.cpu_count())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    usable, threads, machine = (int(x) for x in out.split())
    assert (usable, threads) == (1, 1)
    assert machine >= usable


@needs_affinity
def test_threads_split_the_usable_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(12)))
    assert usable_cpus() == 12
    assert threads_per_process(3) == 4  # a producer and two workers on 12 cores
    assert threads_per_process(3, share=2) == 8  # a threaded worker running two drafters
    assert threads_per_process(20) == 1
    assert threads_per_process(0) == 12
