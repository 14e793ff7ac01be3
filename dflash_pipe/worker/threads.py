"""Threaded mode (``--drafter-mode threads``): one process, one drafter replica per device, one thread each.

The process is one member of the drafters' group and one peer of the producer. Each step its replicas
train up to ``width`` batches in parallel threads (replica i samples anchors like process rank
``rank * width + i``), their gradients are summed onto replica 0 (the one the optimizer steps), and after
the step every replica copies replica 0's weights. The update is the one process mode computes with one
process per replica: gradients summed over every batch, divided by the global CE weight.

Every step runs through the process-wide ``CompileGuard`` (see ``drafter/compile_guard.py``): nothing
compiles while another thread runs compiled code.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from dflash_pipe.compute.compile import apply_dynamo_settings, backward_with_settings
from dflash_pipe.drafter.compile_guard import GUARD, CompileGuard
from dflash_pipe.wire import messages as m
from dflash_pipe.worker.loop import WorkerSession
from dflash_pipe.worker.step import forward_backward


class ThreadedReplicas:
    """``Replicas`` of threaded mode. ``close()`` (safe twice) stops the threads and the compile stance."""

    def __init__(
        self, models: list[torch.nn.Module], devices: list[torch.device], *, guard: CompileGuard = GUARD
    ) -> None:
        if len(models) != len(devices) or not models:
            raise ValueError(
                f"threaded mode needs one device per replica, got {len(models)} and {len(devices)}"
            )
        self.models, self.devices, self.guard = models, devices, guard
        self.width = len(models)
        self._params = [[p for p in model.parameters() if p.requires_grad] for model in models]
        self._pool = ThreadPoolExecutor(
            max_workers=self.width, thread_name_prefix="drafter", initializer=apply_dynamo_settings
        )
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(guard.threaded())
        self.sync()

    def local_pass(self, s: WorkerSession, batches: list[m.Batch]) -> torch.Tensor:
        futures = [self._pool.submit(self._one, s, i, batch) for i, batch in enumerate(batches)]
        wait(futures)  # every thread is done before anything is raised or summed
        totals = sum(f.result() for f in futures)
        master = self._params[0]
        for replica in self._params[1 : len(batches)]:
            for p0, p in zip(master, replica, strict=True):
                if p.grad is not None:
                    p0.grad = p.grad.to(p0.device) if p0.grad is None else p0.grad.add_(p.grad.to(p0.device))
                    p.grad = None
        return totals

    def _one(self, s: WorkerSession, i: int, batch: m.Batch) -> torch.Tensor:
        model, device = self.models[i], self.devices[i]

        def step() -> torch.Tensor:
            return forward_backward(
                s,
                model,
                batch,
                device=device,
                virtual_rank=s.rank * self.width + i,
                backward=backward_with_settings,
            )

        def reset() -> None:  # a step that must compile is re-run alone; drop its partial gradients first
            for p in self._params[i]:
                if p.grad is not None:
                    p.grad.zero_()

        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            return self.guard.run(step, reset=reset)

    @torch.no_grad()
    def sync(self) -> None:
        for replica in self._params[1:]:
            for p0, p in zip(self._params[0], replica, strict=True):
                p.copy_(p0)

    def alone(self) -> contextlib.AbstractContextManager:
        return self.guard.exclusive()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._stack.close()
