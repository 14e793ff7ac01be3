"""How many CPU cores this process may use, and the thread budget of a CPU process of a node.

``os.cpu_count()`` counts the machine's cores, whatever ``taskset``, a cgroup cpuset (containers, Slurm's
``--cpus-per-task``) or a parent's affinity allows: on a 64-core host where a job holds 8, sizing threads
from it oversubscribes the 8 eight times over (and OpenMP threads that wait spin). Every CPU thread budget
of the run is sized from the affinity mask instead; children inherit it, so a node pinned to its cores
(``taskset -c 0-7 dflash-pipe launch ...``) keeps its producer and workers on them.
"""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask; the machine's count where there is none)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_process(processes: int, *, share: int = 1) -> int:
    """Intra-op threads for one of ``processes`` CPU processes that split the usable cores, ``share`` of
    the parts for this one (a threaded worker runs several drafters): at least 1."""
    return max(1, usable_cpus() * share // max(processes, 1))
