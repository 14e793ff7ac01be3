"""The compile guard under stress: many threads, cold cache, many first calls, nothing compiles concurrently."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from dflash_pipe.compute.compile import DYNAMO_SETTINGS, apply_dynamo_settings, backward_with_settings
from dflash_pipe.drafter.compile_guard import CompileGuard, needs_compile

THREADS = 6
SHAPES = [(1, 8), (3, 8), (5, 8), (7, 8)]


@pytest.mark.slow
def test_many_threads_cold_cache_first_calls(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    guard = CompileGuard()
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    # dynamic=False: every shape, and each grad mode, is its own compiled variant (8 first calls).
    fn = torch.compile(lambda x: torch.tanh(lin(x)).pow(2).sum(), dynamic=False)
    active = {"running": 0, "compiling_overlap": 0}
    count = threading.Lock()

    def watched(step):
        """Counts threads inside a step: an exclusive step must never see another one running."""

        def run():
            with count:
                active["running"] += 1
                running = active["running"]
            try:
                if guard._writer and running > 1:
                    active["compiling_overlap"] += 1
                return step()
            finally:
                with count:
                    active["running"] -= 1

        return run

    def worker(seed: int) -> list[tuple[int, bool, float]]:
        rng = random.Random(seed)
        cases = [(i, grad) for i in range(len(SHAPES)) for grad in (True, False)] * 2
        rng.shuffle(cases)
        out = []
        for i, grad in cases:
            x = torch.randn(*SHAPES[i], generator=torch.Generator().manual_seed(i))

            def step(x=x, grad=grad):
                with torch.set_grad_enabled(grad):
                    loss = fn(x)
                    if grad:
                        backward_with_settings(loss)
                return float(loss.detach())

            out.append((i, grad, guard.run(watched(step), reset=lambda: None)))
        return out

    with guard.threaded(), ThreadPoolExecutor(THREADS, initializer=apply_dynamo_settings) as pool:
        results = [r for rs in pool.map(worker, range(THREADS)) for r in rs]

    assert len(results) == THREADS * len(SHAPES) * 4
    for i, _grad, value in results:
        x = torch.randn(*SHAPES[i], generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            expected = float(torch.tanh(lin(x)).pow(2).sum())
        assert value == pytest.approx(expected, rel=1e-5)
    assert active["compiling_overlap"] == 0
    assert guard.exclusive_runs >= len(SHAPES) * 2  # every variant compiled in an exclusive step
    assert torch.compiler.is_compiling() is False


def test_outside_exclusive_a_compile_is_refused_and_recognised():
    guard = CompileGuard()
    fn = torch.compile(lambda x: x * 3 + 1)
    with guard.threaded():
        with pytest.raises(RuntimeError) as caught:
            fn(torch.ones(4))
        assert needs_compile(caught.value)
        with guard.exclusive():
            assert torch.equal(fn(torch.ones(4)), torch.full((4,), 4.0))
        assert torch.equal(fn(torch.ones(4)), torch.full((4,), 4.0))  # compiled now: runs shared


def test_dynamo_settings_are_per_thread():
    """Why every thread applies them: a new thread starts from torch's defaults (torch >= 2.12)."""
    apply_dynamo_settings()
    seen = {}

    def in_thread():
        seen["before"] = torch._dynamo.config.recompile_limit
        apply_dynamo_settings()
        x = torch.ones(2, requires_grad=True)
        backward_with_settings((x * 2).sum())
        seen["grad"] = x.grad.tolist()
        seen["after"] = torch._dynamo.config.recompile_limit

    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    assert seen["after"] == DYNAMO_SETTINGS["recompile_limit"]
    assert seen["grad"] == [2.0, 2.0]
    if torch.__version__ >= "2.12":
        assert seen["before"] != DYNAMO_SETTINGS["recompile_limit"]
