"""Fixtures every test folder may ask for."""

from __future__ import annotations

import os

# Inductor compiles in this process (and in the processes tests start, which inherit it), not in a pool of
# compile workers: on 2 shared cores the pool's processes cost more CPU than they save (bench/compile_sweep.py
# --cpu: 294 s of CPU with the pool, 240 s without; bench compile's test: 177 s, 166 s).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Inductor's CPU kernels compiled scalar, not with SIMD: the same Dynamo, AOT autograd, Inductor, g++ and cache
# steps and the same checks against eager, with less for g++ to parse and optimise. On a cold cache, where a
# fresh clone starts, bench/compile_sweep.py's test took 324 s alone with SIMD and 250 s without.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# OpenMP threads that finish a parallel region sleep instead of spinning (libgomp spins by default): the two
# xdist workers and the processes their tests start share 2 cores, and a spinning thread burns the CPU another
# process is waiting for (bench/compile_sweep.py --cpu beside a one-core busy loop: 118 s spinning, 89 s
# passive). Set before torch loads libgomp, and inherited by the processes tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def one_torch_thread():
    """Tiny models: one thread is many times faster than several fighting over 2 shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
