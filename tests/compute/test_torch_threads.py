"""A daemon thread inside a torch op when the interpreter finalizes aborts the process (SIGABRT, exit -6):
a launch whose drain left a target thread in a long prefill printed its whole summary and still exited -6.
A registered thread makes ``exit_past_computing`` leave at once with the command's code instead."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import threading, torch
from dflash_pipe.compute.torch_threads import computes_torch, exit_past_computing

torch.set_num_threads(2)  # the abort comes from the intra-op pool torn down under the op
inside = threading.Event()
def compute():
    a = torch.randn(3000, 3000)
    inside.set()
    while True:  # as a prefill: op after op, the exit below finds the thread inside one (elementwise ops
        a = (a.exp().sin() + a.cos()).tanh()  # run on the OpenMP pool; a matmul may run on BLAS's own)
thread = threading.Thread(target=compute, name="target-cpu0", daemon=True)
if REGISTER:
    computes_torch(thread)
thread.start()
inside.wait()
print("summary written", flush=True)
exit_past_computing(print, code=0)
"""


def _run(register: bool) -> subprocess.CompletedProcess:
    script = f"REGISTER = {register}\n" + textwrap.dedent(_SCRIPT)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip


def test_a_registered_thread_in_a_torch_op_exits_with_the_commands_code_and_says_so():
    done = _run(register=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "summary written",
        "note: target-cpu0 still computing at exit; leaving without waiting for it (nothing is lost)",
    ]


def test_without_it_the_same_exit_aborts():
    """The hazard the helper exists for (so the test above can fail). A race: the exit must find the thread
    inside an op, and on a loaded machine it can find it between two; so one abort in three tries shows it."""
    tries = []
    for _ in range(3):
        done = _run(register=False)
        tries.append((done.returncode, done.stderr[-500:]))
        if done.returncode == -6:
            break
    assert done.returncode == -6, tries
    assert "terminate called without an active exception" in done.stderr


def test_nothing_registered_alive_returns():
    from dflash_pipe.compute.torch_threads import exit_past_computing, still_computing

    assert still_computing() == []
    said: list[str] = []
    exit_past_computing(said.append)
    assert said == []
